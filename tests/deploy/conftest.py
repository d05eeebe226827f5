"""Fixtures of the deployment tests (defined in tests/daemons.py)."""

from daemons import no_leaked_children  # noqa: F401
