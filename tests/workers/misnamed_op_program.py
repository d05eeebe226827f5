"""A program with an author's error in its capture: it names a plain torch op
(``"mm"``) where ``backend.call`` takes an op of torch_npu's namespace, inside an open
task group. Its worker must fail once, saying ``torch_npu has no op 'mm'``."""

from __future__ import annotations

from prefill_program import PrefillProgram


class MisnamedOp(PrefillProgram):
    name = "misnamed"

    def capture(self, backend, stream, bucket, buffers, events):  # type: ignore[no-untyped-def]
        full = ([self.seq] * bucket, [self.kv] * bucket)
        events[0].wait(stream)
        backend.task_group_begin(stream)
        backend.call("mm", (buffers["query"], buffers["key"]), {})  # the author's error
        return [backend.task_group_end(stream)], [full]
