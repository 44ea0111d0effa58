"""Where a model's bytes live: devices, which block is where, the host pager, relocation across models."""
