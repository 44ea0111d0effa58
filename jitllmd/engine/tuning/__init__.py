"""Choices made for the loaded model: batching at load (from counts), the seam (TuneSeam, measured)."""
