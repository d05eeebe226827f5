"""How the load test checks a model's tokens in half precision (issue 43): a first
different token where transformers' own bfloat16 logits are a near tie (docs/models.md,
"Precision") is a tie, not a failure; the report counts checked, exact, ties and
differences, and never shows a zero error for outputs that differ."""

from __future__ import annotations

import asyncio
import tomllib
from typing import Any

import torch

from graphlane.client.scheduler import ModelShape, Request
from graphlane.demo_model import PROGRAM_TOML
from graphlane.loadtest import LoadConfig
from graphlane.loadtest.generation import DIFFER, EXACT, TIE, Judge, reference_model
from graphlane.loadtest.record import Recorder
from graphlane.loadtest.report import verify_text
from graphlane.loadtest.run import Run
from graphlane.loadtest.serving import Serving

MODEL = tomllib.loads(PROGRAM_TOML)["programs"][0]
#: The demo's model as a daemon's hello describes it, served in bfloat16.
DESCRIBED = {"config": {"random": MODEL["random"], "seed": MODEL["seed"],
                        "init_std": MODEL["init_std"], "dtype": "bfloat16"}}  # fmt: skip
ALLOWANCE = 8 * 2**-8  # docs/models.md, "Precision"


def _generate(model: Any, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    return ref.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in ref.logits]


def _near_tie(model: Any) -> tuple[list[int], list[int], int, int]:
    """A prompt, transformers' tokens after it, a position where the runner-up's logit is
    within the allowance of the best one's, and that runner-up."""
    g = torch.Generator().manual_seed(5)
    for _ in range(40):
        prompt = torch.randint(0, 256, (12,), generator=g).tolist()
        theirs, logits = _generate(model, prompt, 12)
        for i, row in enumerate(logits):
            top = torch.topk(row, 2)
            gap, scale = float(top.values[0] - top.values[1]), float(row.abs().max())
            if gap <= ALLOWANCE * scale and int(top.indices[0]) == theirs[i]:
                return prompt, theirs, i, int(top.indices[1])
    raise AssertionError("no near tie in 40 prompts of the demo model in bfloat16")


def _request(rid: int, prompt: list[int], tokens: list[int]) -> Request:
    r = Request(rid, prompt, len(tokens))
    r.tokens = list(tokens)
    r.times = [0.0] * len(tokens)
    r.received = len(tokens)
    return r


def test_bfloat16_tokens_differing_at_a_near_tie_are_ties_not_failures() -> None:
    model = reference_model(DESCRIBED)
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt, theirs, at, runner_up = _near_tie(model)
    tie = [*theirs[:at], runner_up, *theirs[at + 1 :]]  # the tokens after it: not compared
    _, logits = _generate(model, prompt, len(theirs))
    worst = int(logits[0].argmin())  # far from a tie, and not float32's pick either
    wrong = [worst, *theirs[1:]]
    judge = Judge(model)
    assert judge.allowance == ALLOWANCE
    assert judge(prompt, theirs) == (EXACT, None)
    assert judge(prompt, tie) == (TIE, at)
    assert judge(prompt, wrong) == (DIFFER, 0)

    # The load test's check of a run's requests counts them so.
    config = LoadConfig(endpoint="ipc:///nowhere", duration_s=1.0, rate=1.0, program="model",
                        progress=False)  # fmt: skip
    rec = Recorder(0.0, 0.25, 0)
    run = Run(config, None, rec, stop_at=1.0, stop=asyncio.Event())  # type: ignore[arg-type]
    shape = ModelShape(128, 8, 1, (1, 2), 256, "bfloat16")
    serving = Serving(run, shape, (0,))
    serving.requests = [_request(0, prompt, theirs), _request(1, prompt, tie),
                        _request(2, prompt, wrong)]  # fmt: skip
    asyncio.run(serving.check(DESCRIBED, 1.0))
    assert (rec.verified, rec.verify_ties, rec.verify_failures) == (3, 1, 1)


def test_the_verified_row_counts_ties_and_never_shows_a_zero_error_for_differences() -> None:
    model_run = {"serving": {}, "verify_fraction": 0.2, "verified": 58, "verify_failures": 2,
                 "verify_ties": 25, "verify_max_abs_error": 0.0}  # fmt: skip
    text = verify_text(model_run)
    assert text is not None
    assert "58 requests checked: 31 exact, 25 near ties" in text and "2 differ" in text
    assert "max |out - reference| 0" not in text
    calls = {"verify_fraction": 0.5, "verified": 10, "verify_failures": 3,
             "verify_max_abs_error": 0.0, "verify_tolerance": 0.01}  # fmt: skip
    text = verify_text(calls)
    assert text is not None and "3 wrong" in text and "|out - reference| 0" not in text
    skipped = {"verify_fraction": 0.0, "verify_skipped": "the model directory /m is not on "
               "this machine (the default --verify 0.2)"}  # fmt: skip
    assert verify_text(skipped) == f"not checked: {skipped['verify_skipped']}"
