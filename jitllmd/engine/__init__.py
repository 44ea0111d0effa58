"""Everything that runs a model. Imports nothing from serve/, commands/ or client.py."""
