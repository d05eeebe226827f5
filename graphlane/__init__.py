"""graphlane: keep captured NPU graphs hot and patch their parameters between replays."""

__version__ = "0.1.0"
