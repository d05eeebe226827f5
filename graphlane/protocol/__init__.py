"""The graphlane wire protocol: frames, envelope, tensors, operations, errors.

Transport: ZeroMQ, a scheduler's DEALER to the daemon's ROUTER; every request
gets exactly one reply carrying the request's id. Encoding: msgpack. No pickle,
anywhere.

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

A tensor anywhere in a body (in maps and lists, at any depth) is a one-key map::

    {"$tensor": {"dtype": "float16", "shape": [8, 128], "frame": 1}}      bytes in frame 1
    {"$tensor": {"dtype": "int32", "shape": [8], "data": <bin, 32 bytes>}}   inline

Tensors of at most INLINE_TENSOR_BYTES (1024) bytes go inline, larger ones as
their own frame. The bytes are the tensor's contiguous C-order memory, native
(little-endian) byte order; ``len(bytes) == prod(shape) * itemsize`` exactly.
dtypes: float16, bfloat16, float32, float64, int8, uint8, int16, int32,
int64, bool (one byte, 0 or 1). Each frame is referenced by exactly one tensor;
a frame referenced twice or not at all is a BAD_REQUEST. ``$tensor`` is a
reserved key: no other map may use it.

Frames are sent and received without copies: the encoder hands zmq a
memoryview over each contiguous tensor, the decoder returns tensors that view
the received frames (treat them as read-only).

Bundles
=======

A worker's socket also takes a *bundle*: a single-frame message whose frame 0
is a msgpack array of request envelopes (1 to 65535 of them, within
``Limits.max_items``), none referencing data frames. Each envelope is checked
and answered on its own, as if it had come alone: one bad envelope fails alone,
with its id. The replies to a bundle's requests may come back bundled the same
way (an array of reply envelopes); however they group, each request gets
exactly one reply. The limits of frame 0 (``Limits.max_envelope_bytes``) apply
to the bundle as a whole: a bundle over them is refused, each of its requests
whose id can still be read getting the BAD_REQUEST (up to four times the
limit; a frame 0 larger than that is not read and nobody is answered, for a
single envelope too). So a sender keeps bundles small: graphlane's client and
workers make none over ``codec.BUNDLE_BYTES`` (64 KiB), the client none of
more than 32 requests. Calls that carry tensors as frames never travel in a
bundle. A daemon whose hello ``capabilities`` say ``"bundles": true`` runs
workers that take them; the daemon's own socket does not (an array there is
undecodable). ``codec.bundle`` builds one, ``codec.bundles`` packs envelopes
into messages of bounded size; ``codec.decode_requests`` and
``codec.decode_replies`` read a message of either kind.

Decoding is validation (``codec.decode_request``): sizes and frame count, then
the envelope, then ``id`` (so every later error can be answered), then ``v``
(UNSUPPORTED_VERSION), ``op``, ``body``, unknown envelope keys, and the body
against ``Limits`` (depth, items, string and tensor sizes). A failure is a
``DecodeError`` with a code and, when the id was readable, the id to answer.
Then ``messages.parse_body`` checks the operation's fields.

Operations
==========

Examples as ``frame 0`` (JSON-like notation for msgpack) plus data frames.
Reply bodies are maps produced by the orchestrator; the fields shown for them
are the documented ones, more may appear.

``hello`` — handshake, what the server offers::

    request  {"v": 1, "id": 1, "op": "hello", "body": {"client": "sched-0"}}
    reply    {"v": 1, "id": 1, "ok": true, "body": {"version": 1, "server": "graphlane 0.1.0",
              "capabilities": {"ops": ["hello", "status", "step", ...], "dtypes": [...],
                               "bundles": true},
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
                                                "shape": [8, 32, 1, 128], "frame": 1}}}}}
             frame 1: 65536 bytes of float16

    ``batch`` may be left out: it is then len(params["actual_seq_lengths_kv"]).

``update`` — patch the graph for the next replay only (no ``outputs``)::

    request  {"v": 1, "id": 4, "op": "update", "body": {"program": "attention", "device": 0,
              "batch": 2, "params": {"actual_seq_lengths_kv": [5, 9]}}}
    reply    {"v": 1, "id": 4, "ok": true, "body": {}}

``replay`` — replay the graph as last patched::

    request  {"v": 1, "id": 5, "op": "replay", "body": {"program": "attention", "device": 0,
              "batch": 2, "outputs": ["out"]}}
    reply    {"v": 1, "id": 5, "ok": true, "body": {"outputs": {"out": {"$tensor": {
              "dtype": "float16", "shape": [2, 32, 1, 128], "frame": 1}}}}}
             frame 1: 16384 bytes of float16

``drain`` — finish in-flight work, accept no more (one device, or all without ``device``)::

    request  {"v": 1, "id": 6, "op": "drain", "body": {"device": 0}}
    reply    {"v": 1, "id": 6, "ok": true, "body": {}}

``shutdown`` — drain, stop workers, exit::

    request  {"v": 1, "id": 7, "op": "shutdown", "body": {}}
    reply    {"v": 1, "id": 7, "ok": true, "body": {}}

An error reply, e.g. to a step on a device nobody serves::

    reply    {"v": 1, "id": 3, "ok": false, "error": {"code": "UNKNOWN_DEVICE",
              "message": "no worker serves device 5 (devices: [0, 1])", "retryable": false}}

Error codes (``errors.ErrorCode``, stable strings): BAD_REQUEST, UNKNOWN_PROGRAM,
UNKNOWN_DEVICE, BUSY, WORKER_LOST, TIMEOUT, UNSUPPORTED_VERSION, UNAUTHORIZED,
SHUTTING_DOWN, INTERNAL. Retryable unless the error says otherwise: BUSY,
WORKER_LOST, TIMEOUT, SHUTTING_DOWN.
"""

from graphlane.protocol.codec import (
    DEFAULT_LIMITS,
    DTYPES,
    INLINE_TENSOR_BYTES,
    PROTOCOL_VERSION,
    TENSOR_KEY,
    DecodeError,
    FrameLike,
    Limits,
    Reply,
    Request,
    bundle,
    bundles,
    decode_replies,
    decode_reply,
    decode_request,
    decode_requests,
    encode_error,
    encode_outputs_reply,
    encode_reply,
    encode_request,
    tensor_to_wire,
)
from graphlane.protocol.errors import (
    RETRYABLE,
    BadRequest,
    Busy,
    ErrorCode,
    GraphlaneError,
    InternalError,
    RequestError,
    ServiceError,
    ShuttingDown,
    Timeout,
    Unauthorized,
    UnknownDevice,
    UnknownProgram,
    UnsupportedVersion,
    WorkerLost,
    error_class,
    error_from_wire,
)
from graphlane.protocol.messages import (
    MAX_OUTPUTS,
    MESSAGES,
    DrainRequest,
    Hello,
    Message,
    ReplayRequestMsg,
    ShutdownRequest,
    StatusRequest,
    StepRequestMsg,
    UpdateRequestMsg,
    encode_message,
    parse_body,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPES",
    "INLINE_TENSOR_BYTES",
    "MAX_OUTPUTS",
    "MESSAGES",
    "PROTOCOL_VERSION",
    "RETRYABLE",
    "TENSOR_KEY",
    "BadRequest",
    "Busy",
    "DecodeError",
    "DrainRequest",
    "ErrorCode",
    "FrameLike",
    "GraphlaneError",
    "Hello",
    "InternalError",
    "Limits",
    "Message",
    "ReplayRequestMsg",
    "Reply",
    "Request",
    "RequestError",
    "ServiceError",
    "ShutdownRequest",
    "ShuttingDown",
    "StatusRequest",
    "StepRequestMsg",
    "Timeout",
    "Unauthorized",
    "UnknownDevice",
    "UnknownProgram",
    "UnsupportedVersion",
    "UpdateRequestMsg",
    "WorkerLost",
    "bundle",
    "bundles",
    "decode_replies",
    "decode_reply",
    "decode_request",
    "decode_requests",
    "encode_error",
    "encode_message",
    "encode_outputs_reply",
    "encode_reply",
    "encode_request",
    "error_class",
    "error_from_wire",
    "parse_body",
    "tensor_to_wire",
]
