"""Replies to a bundle's steps are not held back by the bundle's slow steps."""

from __future__ import annotations

import zmq

from graphlane.protocol import ops, wire

SLOW_PATCH_US = 300_000.0  # each step's issue costs 300 ms of modelled host time
#: each replayed task 20 ms: a step still runs for tens of ms after its issue ends, so the
#: reply sent then cannot hold it on a busy host (with 0.1 ms, a loaded suite run saw step
#: 1's replay end before the loop's look and its reply go with step 0's, rightly)
TASK_US = 20_000.0
PROGRAM = {"name": "attention", "layers": 1, "num_heads": 2, "num_kv_heads": 1,
           "head_dim": 8, "max_kv_len": 8, "buckets": [1]}  # fmt: skip


def test_a_finished_steps_reply_does_not_wait_for_the_rest_of_its_bundle(start_daemon) -> None:
    """Three steps in one bundle, each taking 300 ms to issue (one patched layer): the
    first step's replay is done long before the second's issue ends, and its reply
    goes out then, not with the second's (still replaying) or with the whole bundle's."""
    d = start_daemon(
        devices=1,
        sim={"mode": "timed", "patch_us": SLOW_PATCH_US, "task_us": TASK_US},
        programs=[PROGRAM],
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(d.worker(0)["endpoint"])
    try:
        # A step alone on each graph instance of the ring (depth 2) first: the first
        # replays' one-time costs are not the bundle's.
        for warm in (8, 7):
            body = ops.Step("attention", 0, {"actual_seq_lengths_kv": [warm]}, outputs=["out"])
            sock.send(bytes(wire.encode_request(100 + warm, "step", body)[0]))
            assert sock.poll(30_000), "no reply to a first step within 30 s"
            sock.recv_multipart()
        envelopes = [
            bytes(wire.encode_request(i, "step", ops.Step(
                "attention", 0, {"actual_seq_lengths_kv": [1 + i]}, outputs=["out"]))[0])
            for i in range(3)
        ]  # fmt: skip
        sock.send(wire.bundle(envelopes))
        ids: list[list[int]] = []
        while sum(map(len, ids)) < 3:
            assert sock.poll(30_000), f"no reply within 30 s (got {ids})"
            replies = wire.decode_replies(sock.recv_multipart())
            for r in replies:
                assert isinstance(r, wire.Reply) and r.error is None, r
            ids.append([r.id for r in replies if isinstance(r, wire.Reply)])
        assert sorted(i for msg in ids for i in msg) == [0, 1, 2]
        # Step 0's reply went out while step 2 was issued, before step 1 finished.
        assert ids[0] == [0], f"step 0's reply waited for others of its bundle: {ids}"
    finally:
        sock.close(0)
        ctx.destroy(0)
