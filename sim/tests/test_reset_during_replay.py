"""A device reset while a replay is running must drop the replay's later waits.

A replay is one queued entry that runs its nodes in turn. A wait node must give up when
the device was reset after the entry was issued, not only when a reset happens while it
already waits: otherwise a reset that lands while the replay runs an earlier task leaves
the stream waiting on the new epoch for a record that will never come, and
``reset_device()`` (which waits for every stream to drain) hangs.
"""

from __future__ import annotations

import threading
import time

import torch
from npusim import configure, reset_device, torch_npu  # noqa: F401


def test_reset_while_a_replay_runs_a_task_drops_its_later_wait() -> None:
    old = configure()
    configure(mode="timed", task_us=400_000, watchdog_s=600)
    try:
        x = torch.zeros(4).npu()
        ev = torch.npu.ExternalEvent()
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g):
            x.add_(1)  # a task: 0.4 s of modelled device time
            ev.wait(torch.npu.current_stream())  # nothing will record it
        g.replay()
        time.sleep(0.1)  # the stream is inside the first task
        resetter = threading.Thread(target=reset_device, daemon=True)
        resetter.start()
        resetter.join(10)
        assert not resetter.is_alive(), "reset_device hung: the replay's wait outlived the reset"
    finally:
        configure(mode=old.mode, task_us=old.task_us, watchdog_s=old.watchdog_s)
