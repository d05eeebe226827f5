"""``NPUGraph.debug_dump``'s trace and ``torch.npu._npugraph_utils.align_trace_json``.

torch_npu 2.14 (``torch_npu/npu/graphs.py`` ``NPUGraph.debug_dump``) has the runtime print
the captured model as JSON (``aclmdlRIDebugJsonPrint``): a list of Chrome-trace
events, one ``"ph": "X"`` event per task with ``tid`` ``"stream<id>"`` and ``args``
``"Task Type"`` and ``"Stream Id"``, the control tasks named ``EVENT_RECORD_<handle>``,
``EVENT_WAIT_<handle>``, ``EVENT_RESET_<handle>``. After a dump that wrote the file,
``debug_dump`` calls ``_npugraph_utils.align_trace_json(path, None)``, which writes
``<name>.aligned.json``: every stream's tasks from time 0 with a 0.2 gap, each
cross-stream wait stretched to end where its record ends, and a flow (``"ph": "s"`` /
``"f"``) per record/wait pair (torch_npu ``npu/_npugraph_utils.py``). The sim's tasks
have no device time: each lasts 1.0 in the raw dump, in capture order per stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_GAP = 0.2  # torch_npu's fixed visualization gap within a stream
_CONTROL = {"record": "EVENT_RECORD", "wait": "EVENT_WAIT", "reset": "EVENT_RESET"}


def _task(node: Any, sid: int, ts: float) -> dict[str, Any]:
    event = getattr(node, "event", None)
    kind = str(getattr(node, "label", "")).split(" ", 1)[0]
    if event is not None and kind in _CONTROL:
        task_type = _CONTROL[kind]
        name = f"{task_type}_{id(event)}"
    else:
        task_type = "KERNEL"
        name = str(getattr(node, "label", type(node).__name__))
    return {
        "name": name,
        "ph": "X",
        "pid": 0,
        "tid": f"stream{sid}",
        "ts": ts,
        "dur": 1.0,
        "args": {"Task Type": task_type, "Stream Id": sid},
    }


def trace_events(graph: Any) -> list[dict[str, Any]]:
    """The captured graph as the runtime's JSON dump lists it: the capture stream's
    tasks, then each side branch's on a stream of its own."""
    main = graph.capture_stream.stream_id if graph.capture_stream is not None else 0
    lanes = [(main, graph.nodes)]
    for branch in graph.branches:
        stream = branch.stream
        sid = stream.stream_id if stream is not None else 1000 + branch.index
        lanes.append((sid, branch.nodes))
    return [_task(node, sid, float(i)) for sid, nodes in lanes for i, node in enumerate(nodes)]


def _control(name: str) -> tuple[str, str] | None:
    for kind in ("EVENT_RECORD_", "EVENT_WAIT_"):
        if name.startswith(kind):
            return kind[:-1], name.rsplit("_", 1)[-1]
    return None


def align_trace_json(input: Any, output: Any, merge_gap: float = 0.0) -> Path:
    """Write the aligned trace of a dump (``output`` None: ``<name>.aligned.json``)."""
    in_path = Path(input)
    out_path = Path(output) if output else in_path.with_suffix(".aligned.json")
    events: list[dict[str, Any]] = json.loads(in_path.read_text(encoding="utf-8"))
    lanes: dict[Any, list[dict[str, Any]]] = {}
    for ev in events:
        lanes.setdefault(ev.get("tid"), []).append(ev)
    for lane in lanes.values():
        lane.sort(key=lambda e: e.get("ts", 0))
        t = 0.0
        for pos, ev in enumerate(lane):
            ev["ts"] = t + (_GAP if pos else 0.0)
            t = ev["ts"] + ev.get("dur", 0.0)
    pairs: dict[str, dict[str, dict[str, Any]]] = {}
    for ev in events:
        found = _control(ev.get("name", ""))
        if found is not None:
            pairs.setdefault(found[1], {})["record" if found[0] == "EVENT_RECORD" else "wait"] = ev
    cross = [p for p in pairs.values() if len(p) == 2 and p["record"]["tid"] != p["wait"]["tid"]]
    for _ in range(200):  # stretch waits until every one ends at its record's end
        changed = False
        for p in cross:
            rec, wait = p["record"], p["wait"]
            end = rec["ts"] + rec["dur"]
            if wait["ts"] >= end - 1e-9 or abs(wait["ts"] + wait["dur"] - end) <= 1e-9:
                continue
            delta = end - wait["ts"] - wait["dur"]
            wait["dur"] += delta
            lane = lanes[wait["tid"]]
            for ev in lane[lane.index(wait) + 1 :]:
                ev["ts"] += delta
            changed = True
        if not changed:
            break
    else:
        raise RuntimeError("Alignment did not converge within pass limit.")
    flows = []
    for handle, p in pairs.items():
        if len(p) == 2:
            rec, wait = p["record"], p["wait"]
            for ph, ev, ts in (("s", rec, rec["ts"] + rec["dur"]), ("f", wait, wait["ts"])):
                flows.append(
                    {"name": f"PAIR_{handle}", "cat": "event_record->wait", "ph": ph,
                     "pid": ev.get("pid"), "tid": ev.get("tid"), "ts": ts,
                     "id": int(handle) if handle.isdigit() else abs(hash(handle)), "bp": "e"}
                )  # fmt: skip
    out_path.write_text(json.dumps(events + flows, indent=2), encoding="utf-8")
    return out_path
