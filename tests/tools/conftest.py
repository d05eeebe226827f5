"""Fixtures of the tools tests (defined in tests/daemons.py): the load test runs against
a real daemon."""

from daemons import no_leaked_children, start_daemon  # noqa: F401
