"""The scaler: applies a managed job's scale plans through a backend (local, pool)."""
