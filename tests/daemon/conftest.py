"""Fixtures of the daemon tests (defined in tests/daemons.py)."""

from daemons import no_leaked_children, start_daemon  # noqa: F401
