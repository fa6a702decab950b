"""The control plane's logic: each function takes a session and a principal, raises domain
errors, and never does I/O other than the database."""
