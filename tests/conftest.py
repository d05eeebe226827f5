"""Shared fixtures: the simulated NPU is set up once; each test starts with a clean device."""

from __future__ import annotations

import torch
from daemons import shared_daemon, shared_daemons  # noqa: F401  (fixtures)
from npusim.testing import clean_device, float32_attention, no_thread_leak  # noqa: F401

torch.set_num_threads(1)

