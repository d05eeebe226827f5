"""The documentation stays true (issue 27, item 4): docs/api.md documents every public
method of Client and SyncClient with its signature, every wire error code and every
metric; each example config in deploy/examples/ passes ``config check`` and serves its
program; the README's authentication recipe works as written; every relative link in
README.md and docs/*.md reaches an existing file and heading."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import (  # noqa: F401  (no_leaked_children: a fixture)
    SMALL,
    RunningDaemon,
    finish,
    free_port,
    no_leaked_children,
    serve_until_ready,
    wait_for,
)

from graphlane.cli import main
from graphlane.client import Client, SyncClient
from graphlane.orchestrator.metrics import DaemonCollector
from graphlane.orchestrator.supervisor import Supervisor
from graphlane.protocol.errors import RETRYABLE, ErrorCode, UnknownProgram, error_class
from graphlane.workers.programs import _BUILTIN

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.toml"))


# ---------------------------------------------------------------------------- helpers
def _section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole line, e.g. "## Metrics") up to the next
    heading of the same or a higher level."""
    level = len(heading.split(" ")[0])
    start = text.index(f"\n{heading}\n") + 1
    body = start + len(heading) + 1
    ends = [m.start() for m in re.finditer(r"^(#+) ", text[body:], flags=re.M)
            if len(m.group(1)) <= level]  # fmt: skip
    return text[start : body + ends[0]] if ends else text[start:]


def _table(section: str) -> list[list[str]]:
    """The rows of the first markdown table in ``section``, header and rule left out."""
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert len(rows) > 2, f"no table in:\n{section[:300]}"
    return rows[2:]


def _unquote(cell: str) -> str:
    return cell.strip("`")


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _signature(name: str, fn: Any) -> str:
    """``name(a, b=1, *, c=None)``: a callable's parameters as the docs write them."""
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}")
    return f"{name}({', '.join(parts)})"


def _public(cls: type) -> dict[str, Any]:
    return {n: v for n, v in vars(cls).items() if not n.startswith("_")}


# ---------------------------------------------------------------------------- api.md
def test_every_public_method_of_the_clients_is_documented_with_its_signature() -> None:
    doc = API.read_text()
    methods = _section(doc, "## Methods")
    headings = set(re.findall(r"^### (\S+)$", methods, flags=re.M))
    client = _public(Client)
    assert {"step", "update", "replay", "wait_ready", "drain", "worker_status", "kv_write",
            "kv_read", "hello", "status", "hosts"} <= set(client)  # fmt: skip
    assert set(client) <= headings, f"undocumented Client members: {set(client) - headings}"
    for name, member in client.items():
        if isinstance(member, property):
            continue
        sig = _signature(name, member)
        assert f"`{sig}`" in methods, f"docs/api.md: Client.{name} is not shown as `{sig}`"
    assert f"`{_signature('Client', Client.__init__)}`" in doc
    # SyncClient: its table lists every method with the same signature.
    table = _section(doc, "## Client and SyncClient")
    listed = {}
    for row in _table(table[table.index("| SyncClient method") :]):
        method = re.match(r"`(\w+)\(", row[0])
        assert method, f"not a method signature: {row[0]}"
        listed[method.group(1)] = row[0]
    sync = _public(SyncClient)
    assert set(sync) == set(listed), f"SyncClient methods vs its table: {set(sync) ^ set(listed)}"
    for name, member in sync.items():
        assert listed[name] == f"`{_signature(name, member)}`", name
    assert f"`{_signature('SyncClient', SyncClient.__init__)}`" in doc


def test_every_error_code_is_in_the_table_with_its_class_and_retryability() -> None:
    rows = _table(_section(API.read_text(), "### Error codes"))
    documented = {_unquote(code): (cls, retry) for code, cls, retry, *_ in rows}
    assert set(documented) == {str(c) for c in ErrorCode}, set(documented) ^ set(ErrorCode)
    for code, (cls, retry) in documented.items():
        assert _unquote(cls) == error_class(code).__name__, code
        assert retry == ("yes" if ErrorCode(code) in RETRYABLE else "no"), code
    # The README's list of codes is complete too.
    readme = (ROOT / "README.md").read_text()
    missing = [str(c) for c in ErrorCode if str(c) not in readme]
    assert not missing, f"README.md does not name {missing}"


def _documented_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = _table(_section(API.read_text(), "## Metrics"))
    return {
        _unquote(name): (kind, tuple(_unquote(x.strip()) for x in labels.split(",")))
        for name, kind, labels, *_ in rows
    }


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    exposed = {}
    for family in DaemonCollector(Supervisor([])).collect():
        # prometheus_client exposes a counter family as NAME_total
        name = family.name + ("_total" if family.type == "counter" else "")
        exposed[name] = (family.type, tuple(family._labelnames))
    assert len(exposed) >= 10
    assert _documented_metrics() == exposed


def test_the_retry_recipe_retries_what_is_retryable_only(shared_daemon: Any) -> None:
    (recipe,) = [b for b in _blocks(API.read_text(), "python") if "def step_with_retry" in b]
    namespace: dict[str, Any] = {}
    exec(compile(recipe, "docs/api.md:step_with_retry", "exec"), namespace)
    step_with_retry = namespace["step_with_retry"]
    d = shared_daemon(devices=1, programs=[SMALL])

    async def scenario() -> None:
        async with Client(d.endpoint, timeout=30) as c:
            r = await step_with_retry(c, "attention", 0, {"actual_seq_lengths_kv": [3, 5]})
            assert r.outputs["out"].shape[0] == 2
            with pytest.raises(UnknownProgram):  # not retryable: raised at the first attempt
                await step_with_retry(c, "no_such_program", 0, {"actual_seq_lengths_kv": [3]})

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- links
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    out: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug, n = _slug(heading), 1
        while slug in out:
            slug = f"{_slug(heading)}-{n}"
            n += 1
        out.add(slug)
    return out


PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "deploy" / "README.md",
    ROOT / "sim" / "README.md",
]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link {target!r}: {dest} does not exist"
        if anchor:
            assert dest.suffix == ".md", f"{page.name}: link {target!r}: anchor into a non-page"
            assert anchor in _anchors(dest), f"{page.name}: link {target!r}: no such heading"


def test_the_readme_links_every_doc_page_and_example_config() -> None:
    readme = (ROOT / "README.md").read_text()
    linked = {t.partition("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme)}
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    wanted |= {str(p.relative_to(ROOT)) for p in EXAMPLES}
    wanted |= {"docs/api.md", "docs/performance.md", "deploy/README.md", "sim/README.md"}
    assert wanted <= linked, f"README.md does not link {sorted(wanted - linked)}"


# ---------------------------------------------------------------------------- daemons
def _serve(
    tmp_path: Path,
    name: str,
    argv: list[str],
    env: dict[str, str] | None = None,
    **client_keys: str,
) -> RunningDaemon:
    """``ARGV --ready-file PATH`` (a ``graphlane serve`` command line) as a child process,
    returned once its daemon is ready."""
    return serve_until_ready(tmp_path, name, argv, env, client_keys)


def test_there_is_an_example_config_for_every_built_in_program() -> None:
    served = set()
    for path in EXAMPLES:
        served |= {p["name"] for p in tomllib.loads(path.read_text())["programs"]}
    assert set(_BUILTIN) <= served, f"no example config serves {set(_BUILTIN) - served}"


def _exercise(c: SyncClient, program: str, described: dict[str, Any]) -> None:
    """One kv_write + kv_read + step for a program with KV operations, else one step; for
    a model, a prefill and a decode step."""
    cfg = described["config"]
    dtype = getattr(torch, cfg["dtype"])
    if "prefill" in described["state_ops"]:
        first = c.prefill(program, 0, [1, 2, 3], [0] * cfg["max_blocks_per_seq"])
        table = torch.zeros(1, cfg["max_blocks_per_seq"], dtype=torch.int32)
        inputs = {"tokens": first.outputs["tokens"], "block_table": table}
        r = c.step(program, 0, {described["batch_param"]: [4]}, inputs, outputs=["tokens"])
        assert r.outputs["tokens"].shape == (1,)
        return
    if not described["state_ops"]:
        lengths = [5, 3]
        inputs = {
            name: torch.randn([len(lengths) if d == "batch" else d for d in spec["shape"]]).to(
                getattr(torch, spec["dtype"])
            )
            for name, spec in described["inputs"].items()
        }
        r = c.step(program, 0, {described["batch_param"]: lengths}, inputs)
        batch = len(lengths)
    else:
        kv = (cfg["layers"], 3, cfg["num_kv_heads"], cfg["head_dim"])
        key, value = torch.randn(kv).to(dtype), torch.randn(kv).to(dtype)
        c.kv_write(program, 0, torch.tensor([0, 1, 2]), key, value)  # block 0, 3 tokens
        back = c.kv_read(program, 0, torch.tensor([0, 1, 2]))
        assert torch.equal(back.outputs["key"], key) and torch.equal(back.outputs["value"], value)
        table = torch.zeros(1, cfg["max_blocks_per_seq"], dtype=torch.int32)
        inputs = {
            "query": torch.randn(1, cfg["num_heads"], cfg["head_dim"]).to(dtype),
            "key": torch.randn(cfg["layers"], 1, cfg["num_kv_heads"], cfg["head_dim"]).to(dtype),
            "value": torch.randn(cfg["layers"], 1, cfg["num_kv_heads"], cfg["head_dim"]).to(dtype),
            "slot_mapping": torch.tensor([3]),  # the 4th token, block 0
            "block_table": table,
        }
        r = c.step(program, 0, {described["batch_param"]: [4]}, inputs)
        batch = 1
    out = r.outputs["out"]
    assert out.shape[0] == batch and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_config_checks_and_serves_its_programs(
    path: Path, tmp_path: Path, capsys: Any
) -> None:
    assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err
    programs = [p["name"] for p in tomllib.loads(path.read_text())["programs"]]
    # The file as written, on a free port and one device (capture costs time per device),
    # with metrics on: the scrape checks that every exposed metric is in docs/api.md.
    port = free_port(2)
    d = _serve(tmp_path, path.stem, [
        sys.executable, "-m", "graphlane", "serve", "--config", str(path),
        "--listen", f"tcp://127.0.0.1:{port}", "--devices", "1", "--metrics-port", "0",
    ])  # fmt: skip
    try:
        with SyncClient(d.endpoint, timeout=60) as c:
            described = c.hello()["workers"][0]["programs"]
            assert sorted(described) == sorted(programs)
            for program in programs:
                _exercise(c, program, described[program])
            url = c.status()["metrics"]
        if "attention" in programs:  # the first example of docs/api.md, as a script
            example = _blocks(API.read_text(), "python")[0]
            script = example.replace("tcp://127.0.0.1:7450", d.endpoint)
            run = subprocess.run(
                [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
            )
            assert run.returncode == 0, run.stderr
            assert run.stdout.splitlines() == ["2 (2, 8, 1, 64)"] * 2
        with urllib.request.urlopen(url, timeout=10) as reply:
            scraped = set(re.findall(r"^# TYPE (\S+) ", reply.read().decode(), flags=re.M))
        assert scraped and scraped <= set(_documented_metrics()), scraped
    finally:
        finish(d)


def test_the_readme_auth_recipe_works_as_written(tmp_path: Path) -> None:
    """The recipe's lines run in a shell with HOME in tmp_path; its serve line gets a free
    port and one device, its status line that port."""
    readme = (ROOT / "README.md").read_text()
    (recipe,) = _blocks(_section(readme, "### Authentication (CurveZMQ)"), "bash")
    lines = [line.split("  #")[0].strip() for line in recipe.replace("\\\n", " ").splitlines()]
    lines = [line for line in lines if line]
    serve = next(i for i, line in enumerate(lines) if line.startswith("graphlane serve"))
    setup, serve_line, after = lines[:serve], lines[serve], lines[serve + 1 :]
    (status_line,) = after
    assert status_line.startswith("graphlane status")
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PATH":
           f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    env.pop("XDG_CONFIG_HOME", None)
    script = "set -eu\n" + "\n".join(setup)
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    # The later lines run in shells of their own: the recipe's variables first.
    script = "\n".join(line for line in setup if re.match(r"\w+=", line))
    words = subprocess.run(
        ["bash", "-c", f'{script}\nset -- {status_line}\nprintf "%s\\n" "$@"'],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.splitlines()  # fmt: skip
    keys = {flag: words[words.index(f"--{flag.replace('_', '-')}") + 1]
            for flag in ("server_key", "client_key")}  # fmt: skip
    endpoint = f"tcp://127.0.0.1:{free_port(2)}"
    shell = f"{script}\nexec {serve_line} --listen {endpoint} --devices 1"
    d = _serve(tmp_path, "auth", ["bash", "-c", shell + ' "$@"', "bash"], env, **keys)
    try:
        status = subprocess.run(
            ["bash", "-c", f"{script}\n{status_line} --connect {endpoint}"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert "ready=True" in status.stdout
    finally:
        finish(d)


# ---------------------------------------------------------------------------- the README's opening
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_the_readme_opens_with_why_and_when_and_keeps_the_quick_start() -> None:
    """Issue 43, item 9: before anything else, why a daemon instead of the in-process
    graph mode and when, citing vLLM's findings, with no figure of its own (figures
    live in docs/performance.md); the quick start keeps exactly its two commands."""
    text = README.read_text()
    opening = text[: text.index("\n## Quick start\n")]
    why = _section(text, "## Why a daemon, and when")
    assert why.strip() in opening
    for needed in ("vllm-ascend", "interpreter lock", "process of their own",
                   "vllm-project/vllm/issues/6854", "vllm-project/vllm/issues/6797",
                   "docs/performance.md"):  # fmt: skip
        assert needed in why, needed
    assert not re.search(r"\d+(\.\d+)?\s*(ms|us|x\b|%|tok)", why), "figures: docs/performance.md"
    quick = _section(text, "## Quick start")
    blocks = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert blocks == ["bash scripts/dev demo\n", "bash scripts/dev test\n"], blocks


def test_the_glossary_defines_the_words_the_readme_takes_for_granted() -> None:
    text = README.read_text()
    defined = {row[0] for row in _table(_section(text, "## Glossary"))}
    words = {w.strip() for cell in defined for w in cell.split(",")}
    pages = [text[: text.index("\n## Glossary\n")], *(p.read_text() for p in DOCS)]
    used = " ".join(pages).lower()
    for word in ("ENPU", "FIA", "TND", "the field", "task group", "ExternalEvent", "GIL",
                 "bucket", "update", "decoding ahead", "paged KV cache", "CANN"):  # fmt: skip
        assert word in words, f"{word}: not in the README's glossary"
        assert word.lower() in used, f"{word}: defined, used nowhere"
    assert "[glossary](#glossary)" in text[: text.index("\n## Why a daemon")]


def test_the_readme_says_what_ctrl_c_does_to_serve_and_to_the_rest() -> None:
    """Issue 43, item 7: Ctrl-C is "interrupted" and 130 for a command, but serve
    drains and exits 0 (tests/daemon/test_first_hour.py holds the behaviour)."""
    text = " ".join(README.read_text().split())
    assert "Whatever the command, Ctrl-C" not in text
    (sentence,) = re.findall(r"[^.]*Ctrl-C stops a command[^.]*\.[^.]*\.", text)
    assert "130" in sentence and "except `graphlane serve`" in sentence
    assert "drains, stops its workers and exits 0" in sentence
    from graphlane.cli import main as cli_main

    assert "Whatever the command" not in (cli_main.__doc__ or "")


def test_the_readme_says_what_bench_s_exit_status_means() -> None:
    """Issue 43, item 8: each exit status of ``graphlane bench``, as goals.py has it."""
    from graphlane.bench.goals import BUSY_LOAD_PER_CORE, EXIT_FAILED, EXIT_MET, EXIT_NOISY

    text = " ".join(README.read_text().split())
    assert (
        f"`graphlane bench` exits {EXIT_MET} when every goal is met, {EXIT_FAILED} when a goal "
        f"this machine can judge failed, and {EXIT_NOISY} when the only goals that failed "
        "are ones it cannot judge"
    ) in text
    assert BUSY_LOAD_PER_CORE == 0.5 and "a load average above half its cores" in text


def test_the_docs_say_what_loadtest_does_on_ctrl_c_and_how_it_checks_bfloat16() -> None:
    """Issue 43, items 1-3 and 5: the README's Ctrl-C of loadtest (held by
    tests/tools/test_loadtest_interrupt.py), and docs/models.md's check of a model's
    tokens: the bfloat16 allowance is the one the load test applies."""
    import torch

    from graphlane.loadtest.generation import tie_allowance
    from graphlane.loadtest.run import STOP_DRAIN_S

    text = " ".join(README.read_text().split())
    assert "Ctrl-C on `graphlane loadtest` ends the run within a second" in text
    assert STOP_DRAIN_S < 1.0
    models = " ".join((ROOT / "docs" / "models.md").read_text().split())
    assert tie_allowance(torch.bfloat16) == 8 * 2**-8 and tie_allowance(torch.float32) == 0
    assert tie_allowance(torch.float16) == 8 * 2**-11
    allowance = "the bfloat16 allowance, `8 * 2**-8` of the logit scale; float16's `8 * 2**-11`"
    assert allowance in models
    assert "logits for the two tokens must be within `8 * 2**-8` of each other" in models
    for said in ("`verify_ties`", "`verify_skipped`", "no request fails for it (`reprefilled`)"):
        assert said in models, said
