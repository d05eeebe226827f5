"""The error of a program's setting that cannot be used, naming it.

Shared by the processes that read a program's config: a worker builds its programs
(graphlane.workers.programs), ``graphlane config check`` builds them in its own process,
and the tools read a model's architecture (graphlane.hf_model).
"""

from __future__ import annotations


class ProgramConfigError(ValueError):
    """A program configuration that cannot be used: ``key`` names the setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


__all__ = ["ProgramConfigError"]
