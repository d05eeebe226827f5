"""The supervisor-worker pipe: typed messages, msgpack bytes, no pickle.

The daemon's supervisor and each worker process share a ``multiprocessing``
pipe. Only this module's messages cross it, each as one msgpack frame
(``Connection.send_bytes``), tagged by its ``kind``::

    worker -> supervisor   Ready(info)          handshake: the worker serves
                           Failed(message,      handshake: the worker cannot start;
                                  permanent,    permanent: it would fail the same way
                                  traceback)    again (not restarted)
                           Pong(status)         answer to Ping: the worker's figures
    supervisor -> worker   Ping()               health check
                           Finish(stop)         finish in-flight work; exit if stop

End of file on the pipe means the other side died: a worker exits at once.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import msgspec
from msgspec import Struct


class Ready(Struct, frozen=True, tag="ready"):
    info: dict[str, Any]


class Failed(Struct, frozen=True, tag="failed"):
    """Why a worker cannot start. ``message`` is one line: the cause, as ``Type: text``.
    ``permanent``: a restart would fail the same way (a configuration or program error,
    a missing dependency, no such device), so the supervisor does not restart it;
    otherwise (a device fault, memory held by a predecessor) it is restarted with
    backoff. ``traceback``: the cause's formatted traceback (the worker logs it too)."""

    message: str
    permanent: bool = False
    traceback: str = ""


class Pong(Struct, frozen=True, tag="pong"):
    status: dict[str, Any]


class Ping(Struct, frozen=True, tag="ping"):
    pass


class Finish(Struct, frozen=True, tag="finish"):
    stop: bool = False


PipeMessage = Ready | Failed | Pong | Ping | Finish

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PipeMessage)


def send(conn: Connection, message: PipeMessage) -> None:
    conn.send_bytes(_encoder.encode(message))


def recv(conn: Connection) -> PipeMessage:
    """The next message; EOFError when the other side is gone; ValueError for bytes
    that are not one of this module's messages."""
    data = conn.recv_bytes()
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a pipe message: {exc}") from None
