"""``graphlane loadtest``: drive a program of a running daemon as its ``hello`` entry
describes it, and measure it: one config (:class:`.config.LoadConfig`), one run
(:func:`.driver.run_load`), one report. What it does, its report and its exit status:
docs/loadtest.md.
"""

from typing import TYPE_CHECKING, Any

from .config import LoadConfig

if TYPE_CHECKING:
    from .driver import run_load
    from .run import LoadTestError


def __getattr__(name: str) -> Any:
    """run_load and LoadTestError (the run: the client and torch), imported when asked
    for: graphlane's command line reads the load test's flags for every command."""
    if name == "run_load":
        from .driver import run_load

        return run_load
    if name == "LoadTestError":
        from .run import LoadTestError

        return LoadTestError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LoadConfig", "LoadTestError", "run_load"]
