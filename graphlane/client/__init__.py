"""What scheduler processes import: the async :class:`Client`, the blocking
:class:`SyncClient` and the :class:`StepReply` of a step (see :mod:`.client`)."""

from __future__ import annotations

from .client import Client, StepReply
from .sync import SyncClient

__all__ = ["Client", "StepReply", "SyncClient"]
