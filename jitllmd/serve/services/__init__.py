"""The Connect services of the control plane: inference, control, placement, telemetry."""
