"""The graphlane wire protocol: frames, envelope, tensors, operations, errors.

Transport: ZeroMQ, a scheduler's DEALER to the daemon's ROUTER; every request
gets exactly one reply carrying the request's id. Encoding: msgpack, with one
typed definition per message (:mod:`graphlane.protocol.ops` for each operation's
body, :mod:`graphlane.protocol.tensors` for tensors, msgspec Structs that the client
encodes and the server decodes) and one codec that owns the format
(:class:`graphlane.protocol.wire.Codec`: envelopes, frames, bundles, limits). No
pickle, anywhere.

Frame layout
============

A message is a list of frames::

    frame 0       msgpack envelope (at most Limits.max_envelope_bytes)
    frame 1..n    raw bytes of the tensors the envelope references, one per tensor

Request envelope::

    {"v": 1, "id": <uint64>, "op": <str>, "body": <map>}

Reply envelope, ok or error (an error reply is always a single frame)::

    {"v": 1, "id": <same id>, "ok": true,  "body": <map>}
    {"v": 1, "id": <same id>, "ok": false,
     "error": {"code": <str>, "message": <str>, "retryable": <bool>}}

A tensor (where a body's type has one: a step's ``inputs``, a reply's
``outputs``) is a one-key map::

    {"$tensor": {"dtype": "float16", "shape": [8, 128], "frame": 1}}      bytes in frame 1
    {"$tensor": {"dtype": "int32", "shape": [8], "data": <bin, 32 bytes>}}   inline

Tensors of at most INLINE_TENSOR_BYTES (1024) bytes go inline, larger ones as
their own frame. The bytes are the tensor's contiguous C-order memory, native
(little-endian) byte order; ``len(bytes) == prod(shape) * itemsize`` exactly.
dtypes: float16, bfloat16, float32, float64, int8, uint8, int16, int32,
int64, bool (one byte, 0 or 1). Each frame is referenced by exactly one tensor;
a frame referenced twice or not at all is a BAD_REQUEST.

Frames are sent and received without copies: the encoder hands zmq a
memoryview over each contiguous tensor, the decoder returns tensors that view
the received frames (treat them as read-only).

Bundles
=======

A worker's socket also takes a *bundle*: a single-frame message whose frame 0
is a msgpack array of request envelopes (1 to ``Limits.max_bundle``, 256, of them), none
referencing data frames. Each envelope is checked
and answered on its own, as if it had come alone: one bad envelope fails alone,
with its id. The replies to a bundle's requests may come back bundled the same
way (an array of reply envelopes); however they group, each request gets
exactly one reply. The limits of frame 0 (``Limits.max_envelope_bytes``) apply
to the bundle as a whole: a bundle over them, or of more than ``max_bundle``
requests, is refused unread (nobody is answered; the server counts it). So a
sender keeps bundles small: graphlane's client and workers make none over
``wire.BUNDLE_BYTES`` (64 KiB) nor of more than ``wire.BUNDLE_MAX`` (32) envelopes.
Calls that carry tensors as frames never travel in a bundle. A daemon
whose hello ``capabilities`` say ``"bundles": true`` runs workers that take
them; the daemon's own socket answers each request of a bundle with
BAD_REQUEST. ``wire.bundle`` builds one, ``wire.bundles`` packs envelopes into
messages of bounded size; a codec's ``decode_requests`` and ``decode_replies``
read a message of either kind.

Decoding is validation (one codec does it, :class:`wire.Codec`): frame count and
sizes (:class:`admission.Limits`), before any byte is decoded (over them: TOO_LARGE,
to the id the envelope names in its first bytes); then each request in one typed pass,
envelope, body (with its op's type, :data:`ops.OPS`) and tensors (over the frames)
together, which reads no deeper than the types allow. A request that does not pass
is explained in this order: the shape of what is read untyped (nesting depth,
``Limits.max_depth``, 32, the envelope being level 1, and entries per array or map,
``max_items``), walked without recursion before any decoder sees it (:mod:`.admission`:
a BAD_REQUEST naming the id); the envelope, typed (``v``, ``id``, ``op``; an unknown
envelope key is refused); ``v`` (UNSUPPORTED_VERSION, also for an envelope of another
version that does not fit this one's); ``op`` (an unknown op is a BAD_REQUEST); then
the body: an unknown field, a missing one, a wrong type or a value outside its bounds
(lengths of names, lists and maps, tensor dimensions and bytes) is a BAD_REQUEST
naming the field (``body.device: expected `int` >= 0``). An envelope that cannot be
read is looked at once more, leniently, for its ``id``: if one is found the sender
gets its BAD_REQUEST, else the message is dropped and counted. Replies are read the
same way, their bodies when the caller names the op they answer (``Reply.body``).
Whatever bytes arrive give a request or a ``DecodeError``, never another exception
(one nobody foresaw is logged and becomes a BAD_REQUEST).

A message over a size limit is answered TOO_LARGE while its frames are under the
receiving socket's ``ZMQ_MAXMSGSIZE`` (a worker's ``max_message_bytes``, 256 MiB;
the daemon's 4 MiB): libzmq cuts the connection of a peer that sends a larger
frame, with no reply. hello's ``capabilities`` name the workers' limits
(``max_message_bytes``, ``max_envelope_bytes``, ``max_frames``); graphlane's
client checks each message against them and raises TOO_LARGE without sending it.

Operations
==========

Examples as ``frame 0`` (JSON-like notation for msgpack) plus data frames.
Reply bodies are maps produced by the orchestrator; the fields shown for them
are the documented ones, more may appear.

``hello`` — handshake, what the server offers::

    request  {"v": 1, "id": 1, "op": "hello", "body": {"client": "sched-0"}}
    reply    {"v": 1, "id": 1, "ok": true, "body": {"version": 1, "server": "graphlane 0.1.0",
              "capabilities": {"ops": ["hello", "status", "step", ...], "dtypes": [...],
                               "bundles": true, "max_message_bytes": 268435456,
                               "max_envelope_bytes": 1048576, "max_frames": 64},
              "workers": [{"device": 0, "state": "ready", "programs": ["attention"]}]}}

``status`` — state of the daemon and its workers::

    request  {"v": 1, "id": 2, "op": "status", "body": {}}
    reply    {"v": 1, "id": 2, "ok": true, "body": {"state": "running",
              "workers": [{"device": 0, "state": "ready", "queued": 0, "steps": 1042}]}}

``step`` — patch the graph with ``params``, copy ``inputs``, replay, return ``outputs``::

    request  {"v": 1, "id": 3, "op": "step", "body": {
                "program": "attention", "device": 0, "batch": 8,
                "params": {"actual_seq_lengths_kv": [17, 3, 40, 9, 1, 64, 22, 5]},
                "inputs": {"query": {"$tensor": {"dtype": "float16",
                                                 "shape": [8, 32, 1, 128], "frame": 1}}},
                "outputs": ["out"], "timeout_ms": 500}}
             frame 1: 65536 bytes of float16
    reply    {"v": 1, "id": 3, "ok": true, "body": {
                "outputs": {"out": {"$tensor": {"dtype": "float16",
                                                "shape": [8, 32, 1, 128], "frame": 1}}},
                "bucket": 8, "instance": 0, "patched": 4, "server_us": 812.5}}
             frame 1: 65536 bytes of float16

    ``batch`` may be left out when the program can tell it from its params (the
    attention program: the length of ``actual_seq_lengths_kv``). ``timeout_ms``:
    a step that has waited in the worker's queue longer than that is answered
    TIMEOUT without running (its caller has given up; graphlane's client sends
    each call's timeout). Bounds: ``ops.steps`` (names <= 128 bytes, <= 64
    params and inputs, <= 4096 items per list, <= 16 outputs).

``update`` — patch the graph for the next replay only (no ``outputs``)::

    request  {"v": 1, "id": 4, "op": "update", "body": {"program": "attention", "device": 0,
              "batch": 2, "params": {"actual_seq_lengths_kv": [5, 9]}}}
    reply    {"v": 1, "id": 4, "ok": true, "body": {"bucket": 2, "instance": 0, "patched": 4}}

``replay`` — replay the graph as last patched (refused with BAD_REQUEST for a program
with device state, whose hello entry says ``"replay": false``)::

    request  {"v": 1, "id": 5, "op": "replay", "body": {"program": "attention", "device": 0,
              "batch": 2, "outputs": ["out"]}}
    reply    {"v": 1, "id": 5, "ok": true, "body": {"outputs": {"out": {"$tensor": {
              "dtype": "float16", "shape": [2, 32, 1, 128], "frame": 1}}}}}
             frame 1: 16384 bytes of float16

Every reply of a worker to step, update, replay, kv_write and kv_read names the
worker's ``generation`` (its body's ``generation``; hello and status give it per
worker): an integer unique across daemon starts (a random instance number of the
daemon times 2**22 plus that device's worker's restart count; docs/programs.md).

``kv_write`` — write a prompt's KV (every layer) into slots of a program's paged KV
cache; ``kv_read`` — read the KV of slots back (:mod:`.ops.kv`)::

    request  {"v": 1, "id": 8, "op": "kv_write", "body": {"program": "paged_attention",
              "device": 0, "generation": 0,
              "slots": {"$tensor": {"dtype": "int64", "shape": [130], "frame": 1}},
              "key": {"$tensor": {"dtype": "float16", "shape": [2, 130, 2, 64], "frame": 2}},
              "value": {"$tensor": {"dtype": "float16", "shape": [2, 130, 2, 64], "frame": 3}}}}
    reply    {"v": 1, "id": 8, "ok": true, "body": {"generation": 0, "server_us": 410.0}}
    request  {"v": 1, "id": 9, "op": "kv_read", "body": {"program": "paged_attention",
              "device": 0, "generation": 0, "slots": {"$tensor": {"dtype": "int64",
              "shape": [2], "data": <bin, 16 bytes>}}}}
    reply    {"v": 1, "id": 9, "ok": true, "body": {"generation": 0, "outputs": {
              "key": {"$tensor": {...shape [2, 2, 2, 64]...}}, "value": {...}}}}

    Slot ``s`` is position ``s % block_size`` of block ``s // block_size``; the
    program's hello entry gives ``state``: ``num_blocks``, ``block_size``. Limits:
    ``slots`` 1-D int64 or int32, 1..num_blocks*block_size entries, each in
    0..num_blocks*block_size-1, distinct for kv_write; ``key``/``value`` exactly
    [layers, n, num_kv_heads, head_dim] in the program's dtype; and the message
    limit (``Limits.max_message_bytes``): a prompt too large for one message is
    written in several kv_writes. Both are ordered with the program's replays as
    sent: a kv_write sent before a step is seen by it, a kv_read sees every step and
    write sent before it (the worker issues them on the stream the replays run on).
    The scheduler manages the blocks (which are free, which a sequence holds);
    nothing is reset when a sequence ends.

Generation. A request that depends on device state (step, update or replay of a
program whose hello entry lists ``state_ops``, and kv_write/kv_read) must carry the
``generation`` it expects (BAD_REQUEST without it); any request carrying a generation
other than the worker's is refused with STATE_LOST. A restarted worker starts with
an empty cache: a scheduler that gets STATE_LOST re-reads the generation (hello),
writes its sequences' KV again (kv_write) and continues; no step ever returns numbers
computed on a cache that was lost. graphlane's client fills ``generation`` from the
hello it read when it first reached the device, and adopts a new one only when asked
(``Client.reset_state``).

``resume`` — sent to a worker after a kv_write or step of a program with device state
failed (any error but STATE_LOST): until it arrives, the worker refuses the
connection's requests to such programs with PREDECESSOR_FAILED (docs/programs.md,
"Ordering and retries"; graphlane's client sends it by itself)::

    request  {"v": 1, "id": 10, "op": "resume", "body": {"device": 0}}
    reply    {"v": 1, "id": 10, "ok": true, "body": {"resumed": 8}}

``drain`` — finish in-flight work, accept no more (one device, or all without ``device``;
sent to a worker's socket, that worker)::

    request  {"v": 1, "id": 6, "op": "drain", "body": {"device": 0}}
    reply    {"v": 1, "id": 6, "ok": true, "body": {}}

``shutdown`` — drain, stop workers, exit::

    request  {"v": 1, "id": 7, "op": "shutdown", "body": {}}
    reply    {"v": 1, "id": 7, "ok": true, "body": {}}

With CurveZMQ and roles configured (docs/security.md), ``drain`` and ``shutdown`` need an
admin key, and a program whose config names its ``clients`` serves only those keys; any
other admitted key gets FORBIDDEN.

An error reply, e.g. to a step on a device nobody serves::

    reply    {"v": 1, "id": 3, "ok": false, "error": {"code": "UNKNOWN_DEVICE",
              "message": "no worker serves device 5 (devices: [0, 1])", "retryable": false}}

Error codes (``errors.ErrorCode``, stable strings): BAD_REQUEST, TOO_LARGE (the
message's bytes, its envelope's bytes or its frame count are over the receiver's
limits: not retryable as is), UNKNOWN_PROGRAM, UNKNOWN_DEVICE, BUSY, WORKER_LOST,
TIMEOUT, UNSUPPORTED_VERSION, UNAUTHORIZED (the CURVE handshake was refused: raised by
the client, the server sends nothing), FORBIDDEN (the key is admitted but its role does
not allow the operation), SHUTTING_DOWN, INTERNAL, STATE_LOST (the request names a
worker generation that is gone with its device state: not retryable until the state is
written again), PREDECESSOR_FAILED (an earlier kv_write or step of the same connection
was not applied: see ``resume``), NO_PREVIOUS_TOKEN (a step row of the ``model``
program asks for its sequence's previous sampled token, decoding ahead, and the worker
has none it may feed). Retryable unless the error says otherwise: BUSY,
WORKER_LOST, TIMEOUT, SHUTTING_DOWN, PREDECESSOR_FAILED.
"""

from typing import Any

from graphlane.protocol.errors import (
    RETRYABLE,
    BadRequest,
    Busy,
    ErrorCode,
    Forbidden,
    GraphlaneError,
    InternalError,
    NoPreviousToken,
    PredecessorFailed,
    RequestError,
    ServiceError,
    ShuttingDown,
    StateLost,
    Timeout,
    TooLarge,
    Unauthorized,
    UnknownDevice,
    UnknownProgram,
    UnsupportedVersion,
    WorkerLost,
    error_class,
    error_from_wire,
)
from graphlane.protocol.ops import (
    OPS,
    DeviceResult,
    Drain,
    Hello,
    KvRead,
    KvWrite,
    Op,
    Replay,
    Resume,
    Shutdown,
    Status,
    Step,
    Update,
)
from graphlane.protocol.tensors import INLINE_TENSOR_BYTES, TENSOR_KEY, tensor_ref
from graphlane.protocol.wire import (
    BUNDLE_BYTES,
    BUNDLE_MAX,
    CODEC,
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Codec,
    DecodeError,
    FrameLike,
    Limits,
    Reply,
    Request,
    bundle,
    bundles,
    decode_replies,
    decode_requests,
    encode_error,
    encode_reply,
    encode_request,
)

__all__ = [
    "BUNDLE_BYTES",
    "BUNDLE_MAX",
    "CODEC",
    "DEFAULT_LIMITS",
    "INLINE_TENSOR_BYTES",
    "OPS",
    "PROTOCOL_VERSION",
    "RETRYABLE",
    "TENSOR_KEY",
    "WIRE_DTYPES",
    "BadRequest",
    "Busy",
    "Codec",
    "DecodeError",
    "DeviceResult",
    "Drain",
    "ErrorCode",
    "Forbidden",
    "FrameLike",
    "GraphlaneError",
    "Hello",
    "InternalError",
    "KvRead",
    "KvWrite",
    "Limits",
    "NoPreviousToken",
    "Op",
    "PredecessorFailed",
    "Replay",
    "Reply",
    "Request",
    "RequestError",
    "Resume",
    "ServiceError",
    "Shutdown",
    "ShuttingDown",
    "StateLost",
    "Status",
    "Step",
    "Timeout",
    "TooLarge",
    "Unauthorized",
    "UnknownDevice",
    "UnknownProgram",
    "UnsupportedVersion",
    "Update",
    "WorkerLost",
    "bundle",
    "bundles",
    "decode_replies",
    "decode_requests",
    "encode_error",
    "encode_reply",
    "encode_request",
    "error_class",
    "error_from_wire",
    "tensor_ref",
]


def __getattr__(name: str) -> Any:  # WIRE_DTYPES: torch's dtypes, imported when asked for
    if name == "WIRE_DTYPES":
        from graphlane.protocol import tensors

        return tensors.WIRE_DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
