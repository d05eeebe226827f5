"""The worker process's entry point, as the orchestrator spawns it: the worker (and torch)
is imported in the child process only (:mod:`graphlane.workers.worker`)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from graphlane.workers.spec import WorkerSpec


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's entry point (multiprocessing spawn)."""
    from graphlane.workers.worker import worker_main as main

    main(spec, conn)


def group_main(spec: WorkerSpec, conn: Connection) -> None:
    """A tensor-parallel group's rank's entry point (:mod:`graphlane.workers.group`)."""
    from graphlane.workers.group import group_main as main

    main(spec, conn)


__all__ = ["group_main", "worker_main"]
