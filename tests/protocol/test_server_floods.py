"""What one peer's flood costs a server (issue 40, 7): a bundle holds at most
``Limits.max_bundle`` requests (more is refused unread, before any is answered), and a
request the server fails on (a bug: INTERNAL) logs its traceback only the first few
times, then one line per interval with the count."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from graphlane.protocol import ErrorCode, ops, wire
from graphlane.protocol.admission import DEFAULT_LIMITS, Limits
from graphlane.protocol.server import Origin, Responder


def _status_bundle(n: int) -> bytes:
    envelopes = [bytes(wire.encode_request(i + 1, "status", ops.Status())[0]) for i in range(n)]
    return b"\xdc" + n.to_bytes(2, "big") + b"".join(envelopes)


class _Handler:
    def __init__(self, fail: bool = False) -> None:
        self.answered = 0
        self.fail = fail

    def answer(self, req: wire.Request, origin: Origin) -> Any:
        self.answered += 1
        if self.fail:
            raise RuntimeError("a bug in a handler")
        return {"state": "ready"}

    def refused(self, error: Any, origin: Origin) -> None:
        return None


def _responder(handler: _Handler, sent: list[Any], log: logging.Logger) -> Responder:
    codec = wire.Codec(DEFAULT_LIMITS)
    return Responder(codec, handler, lambda ident, frames, bundled: sent.append(frames), log)


def test_a_bundle_over_the_bound_is_refused_unread_and_one_at_it_is_answered() -> None:
    bound = DEFAULT_LIMITS.max_bundle
    assert wire.BUNDLE_MAX <= bound <= 1024
    handler, sent = _Handler(), []
    responder = _responder(handler, sent, logging.getLogger("test.floods"))
    responder.message([b"peer", _status_bundle(bound)])
    assert handler.answered == bound and len(sent) == bound
    responder.message([b"peer", _status_bundle(40_000)])  # 0.96 MB asking ~120 MB
    assert handler.answered == bound and len(sent) == bound  # nothing done, nothing sent
    assert responder.counters["undecodable"] == 1
    with pytest.raises(wire.DecodeError) as err:
        wire.Codec(Limits(max_bundle=8)).decode_requests([_status_bundle(9)])
    assert err.value.code == ErrorCode.TOO_LARGE and err.value.request_id is None


def test_internal_errors_log_a_few_tracebacks_then_a_counted_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler, sent = _Handler(fail=True), []
    log = logging.getLogger("test.floods.internal")
    responder = _responder(handler, sent, log)
    with caplog.at_level(logging.ERROR, logger=log.name):
        for i in range(2000):
            responder.message([b"peer", bytes(wire.encode_request(i, "status", ops.Status())[0])])
    assert handler.answered == 2000 and len(sent) == 2000  # each answered INTERNAL
    assert wire.decode_replies(sent[-1])[0].error.code == ErrorCode.INTERNAL  # type: ignore[union-attr]
    records = [r for r in caplog.records if r.name == log.name]
    with_traceback = [r for r in records if r.exc_info]
    assert 1 <= len(with_traceback) <= 10
    assert len(records) <= len(with_traceback) + 2  # within one interval: one line more
    assert "RuntimeError: a bug in a handler" in records[-1].getMessage()
