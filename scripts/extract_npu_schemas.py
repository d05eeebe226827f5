"""Extract the registered schemas of the ops the sim serves from a torch_npu wheel.

    python scripts/extract_npu_schemas.py torch_npu-2.14.0-cp311-...whl \
        > sim/tests/data/torch_npu_2.14.0_schemas.json

(get the wheel with ``pip download --no-deps torch-npu==2.14.0``). Nothing of
the wheel is kept except the schema strings printed.

Most schemas sit in the shared libraries as plain C strings. Some (the ATB ops
such as ``_npu_paged_attention``) do not: the compiler builds them on the stack
from 16-, 8-, 4-, 2- and 1-byte constants, so ``strings`` shows them as
16-byte fragments. For those this script disassembles the library with
``objdump`` and replays the constant stores of each basic block to rebuild the
text. The output maps each op name to its schema; the fused update binding
``torch_npu._C._npu_fused_infer_attention_score_out_graph`` is a pybind
function whose argument parser uses C++ type names, kept apart under
``python_arg_parser``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OPS = (
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score.out",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "_npu_fused_infer_attention_score_infer_output",
    "npu_fused_infer_attention_score_v2",
    "npu_fused_infer_attention_score_v2.out",
    "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_fused_infer_attention_score_v2_infer_output",
    "_npu_paged_attention",
    "_npu_paged_attention_get_workspace",
    "_npu_flash_attention_qlens",
    # the field's fused ops (sim/src/npusim/fused_ops.py)
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_rotary_mul",
    "npu_apply_rotary_pos_emb",
    "npu_mrope",
    "_npu_rotary_embedding",
    "npu_swiglu",
    "npu_scatter_pa_kv_cache",
    "_npu_reshape_and_cache",
    "npu_top_k_top_p",
)
LIBRARIES = ("torch_npu/lib/libtorch_npu.so", "torch_npu/lib/libop_plugin_atb.so")
_STORE = r"(XMMWORD|QWORD|DWORD|WORD|BYTE) PTR \[([^\]]+?)(?:([+-])0x([0-9a-f]+))?\],(\S+)$"
_SIZES = {"XMMWORD": 16, "QWORD": 8, "DWORD": 4, "WORD": 2, "BYTE": 1}


def plain_strings(data: bytes) -> list[str]:
    return [m.decode() for m in re.findall(rb"[\x20-\x7e]{20,}", data)]


def stack_built_strings(path: Path) -> list[str]:
    """Texts that the code stores piecewise: replay constant stores per basic block."""
    data = path.read_bytes()
    lines = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-M", "intel", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    regs: dict[str, bytes] = {}
    mem: dict[tuple[str, int], bytes] = {}
    found: list[str] = []

    def flush() -> None:
        spans: dict[str, dict[int, int]] = {}
        for (base, off), chunk in mem.items():
            for i, c in enumerate(chunk):
                spans.setdefault(base, {})[off + i] = c
        for buf in spans.values():
            run: list[int] = []
            prev = None
            for o in sorted(buf):
                if prev is not None and o != prev + 1:
                    found.append(bytes(run).decode("latin-1"))
                    run = []
                run.append(buf[o])
                prev = o
            found.append(bytes(run).decode("latin-1"))
        mem.clear()
        regs.clear()

    for line in lines:
        m = re.match(r"\s*[0-9a-f]+:\s+(\S+)\s*(.*)", line)
        if not m:
            continue
        op, args = m.groups()
        if op.startswith(("call", "ret", "jmp")):
            flush()
            continue
        load = re.match(r"(xmm\d+),XMMWORD PTR \[rip\+0x[0-9a-f]+\]\s+# ([0-9a-f]+)", args)
        if op in ("movdqa", "movaps", "movdqu", "movups") and load:
            addr = int(load.group(2), 16)  # the read-only segment maps at file offset 0
            regs[load.group(1)] = data[addr : addr + 16]
            continue
        imm = re.match(r"(\w+),0x([0-9a-f]+)$", args)
        if op in ("movabs", "mov") and imm:
            regs[imm.group(1)] = int(imm.group(2), 16).to_bytes(8, "little")
            continue
        store = re.match(_STORE, args)
        if op.startswith("mov") and store:
            kind, base, sign, off, src = store.groups()
            offset = (int(off, 16) if off else 0) * (-1 if sign == "-" else 1)
            n = _SIZES[kind]
            if src.startswith("0x"):
                chunk = int(src, 16).to_bytes(8, "little")[:n]
            else:
                value = regs.get(src) or regs.get("r" + src[1:])
                if value is None:
                    continue
                chunk = value[:n]
            if len(chunk) == n:
                mem[(base, offset)] = chunk
    flush()
    return found


def schema_of(name: str, texts: list[str]) -> str | None:
    for text in texts:
        start = text.find(name + "(")
        if start < 0 or (start > 0 and (text[start - 1].isalnum() or text[start - 1] == "_")):
            continue
        candidate = text[start:]
        end = candidate.find("\x00")
        candidate = candidate if end < 0 else candidate[:end]
        if "->" in candidate and "Tensor" in candidate:
            return candidate.strip()
    return None


def schemas_and_parser(texts: list[str], wheel: str) -> tuple[dict[str, str], str]:
    """The schema of every op of OPS, and the Python argument parser string of the fused
    update binding, from the strings of the wheel's libraries."""
    schemas = {}
    for name in OPS:
        schema = schema_of(name, texts)
        if schema is None:
            sys.exit(f"schema of {name} not found in {wheel}")
        schemas[name] = schema
    fia = "npu_fused_infer_attention_score("
    parser = next(t for t in texts if t.startswith(fia) and "TensorList out" in t)
    return schemas, parser


def main(wheel: str) -> None:
    texts: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        for member in LIBRARIES:
            path = Path(tmp) / Path(member).name
            path.write_bytes(zf.read(member))
            texts += plain_strings(path.read_bytes())
            texts += stack_built_strings(path)
    schemas, parser = schemas_and_parser(texts, wheel)
    snapshot = {
        "wheel": Path(wheel).name,
        "schemas": schemas,
        "python_arg_parser": {"_npu_fused_infer_attention_score_out_graph": parser},
    }
    json.dump(snapshot, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
