"""Alembic migrations of the control-plane store (run by gpucloud.control.db.upgrade)."""
