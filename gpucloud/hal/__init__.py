"""Hardware abstraction: every backend-specific choice lives here (see device.py, ops.py)."""
