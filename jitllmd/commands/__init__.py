"""One module per CLI verb."""
