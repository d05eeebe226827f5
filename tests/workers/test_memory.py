"""The worker keeps large freed buffers mapped (glibc malloc thresholds)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's malloc"
)

# Rounds of two 8 MiB buffers (as a step's key and value frames), touched and
# freed; the page faults of each round.
_ROUNDS = """
import json, resource, sys
from graphlane.workers.memory import keep_freed_buffers
tuned = keep_freed_buffers() if sys.argv[1] == "tuned" else None
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a, b = bytearray(8 * 2**20), bytearray(8 * 2**20)
    a[::4096] = bytes(len(a[::4096])); b[::4096] = bytes(len(b[::4096]))
    del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "faults": faults}))
"""


def _rounds(mode: str, **env: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_freed_buffers_are_reused_without_page_faults() -> None:
    tuned = _rounds("tuned")
    assert tuned["tuned"] is True
    first, *later = tuned["faults"]  # type: ignore[misc]
    assert max(later) < first / 10, tuned  # the first round maps the pages, later ones reuse them
    # Without the thresholds, glibc hands the pages back and maps them again: the
    # rounds fault over their whole size (4096 pages), so the check above can fail.
    plain = _rounds("plain")
    plain_first, *plain_later = plain["faults"]  # type: ignore[misc]
    assert sum(f > plain_first / 2 for f in plain_later) >= 2, plain


def test_the_users_own_malloc_settings_are_kept() -> None:
    assert _rounds("tuned", MALLOC_TRIM_THRESHOLD_="1048576")["tuned"] is False
    assert _rounds("tuned", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")["tuned"] is False
