"""Logging of the daemon and its workers: one line per event, text or JSON.

Lifecycle events (worker start/ready/lost/restarted/hung/stop, drain, shutdown)
are logged with ``key=value`` pairs (device, pid, ...); with ``--log-format
json`` each line is a JSON object with ``ts``, ``level``, ``logger``,
``process`` and ``msg``, plus those pairs as fields.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_PAIR = re.compile(r"(\w+)=(\S+)")


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "process": self.process_name,
            "pid": record.process,
            "msg": msg,
        }
        for key, value in _PAIR.findall(msg):
            entry.setdefault(key, int(value) if value.isdigit() else value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: int | str, fmt: str = "text", process_name: str = "daemon") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {process_name} %(name)s %(levelname)s %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class Throttled:
    """Log a recurring event at most once per ``interval_s``, counting the ones skipped,
    so that a flood of bad input cannot turn into a flood of log lines. With
    ``tracebacks`` N, the first N events that carry an exception are logged each with
    its traceback; after them, every line is one line (the exception's type and
    message, no traceback), at most one per interval."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = 5.0, tracebacks: int = 0
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = 0.0
        self._skipped = 0
        self._tracebacks = tracebacks
        self._one_line = tracebacks > 0  # past the first N: no more tracebacks

    def warning(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """Log ``msg % args`` unless one was logged within the interval; ``exc_info``:
        the exception that caused it, its traceback logged too."""
        self.log(logging.WARNING, msg, *args, exc_info=exc_info)

    def error(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """As :meth:`warning`, at level ERROR."""
        self.log(logging.ERROR, msg, *args, exc_info=exc_info)

    def log(
        self, level: int, msg: str, *args: object, exc_info: BaseException | None = None
    ) -> None:
        if exc_info is not None and self._tracebacks > 0:  # one of the first N: in full
            self._tracebacks -= 1
            self.logger.log(level, msg, *args, exc_info=exc_info)
            return
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._skipped += 1
            return
        if exc_info is not None and self._one_line:
            msg = f"{msg}: %s: %s"
            args = (*args, type(exc_info).__name__, " ".join(str(exc_info).split()))
            exc_info = None
        if self._skipped:
            msg = f"{msg} (and {self._skipped} more like it since the last report)"
        self._last, self._skipped = now, 0
        self.logger.log(level, msg, *args, exc_info=exc_info)
