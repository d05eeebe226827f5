"""The model program's sampler at the function level (plain CPU tensors, the ops the
graph captures): never a token that top-k or top-p removed, ``top_k`` 1 is greedy,
the distribution is transformers' (temperature, top-k, top-p logits processors), and
the hash's uniform is strictly inside (0, 1)."""

from __future__ import annotations

import math

import torch

from graphlane.workers.programs.sampling import (
    _K2,
    _K3,
    CANDIDATES,
    U_MAX,
    needs,
    row_keys,
    sample,
    token_codes,
    uniform,
)

VOCAB = 131072  # Llama 3's vocabulary


def _keys(seeds: range | list[int], positions: list[int]) -> torch.Tensor:
    return torch.tensor(
        [row_keys(s, p) for s, p in zip(seeds, positions, strict=True)], dtype=torch.int32
    )


def test_the_uniform_is_strictly_inside_0_1_for_every_hash_value() -> None:
    """Every int32 the hash can end on, at the extremes where float32 rounds to 0 or 1
    (the old hash rounded to 1.0, its noise was +inf and removed tokens were drawn)."""
    inverse = pow(_K2 * _K3, -1, 1 << 32)  # odd multipliers: a bijection of int32
    ends = [*range(-(2**31), -(2**31) + 4096), *range(2**31 - 4096, 2**31), -1, 0, 1]
    codes = [(x * inverse) % (1 << 32) for x in ends]
    codes_t = torch.tensor([c - (1 << 32) if c >= 1 << 31 else c for c in codes])
    u = uniform(torch.zeros(1, 2, dtype=torch.int32), codes_t.to(torch.int32)[None, :])
    assert bool(((u > 0) & (u < 1)).all()) and float(u.max()) == U_MAX
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_no_draw_leaves_top_k_or_top_p_and_top_k_1_is_greedy() -> None:
    """100,000 draws at a 128k vocabulary: each drawn token is among its row's top_k
    (1..8) and within its top_p set; top_k 1 gives the argmax for every seed."""
    g = torch.Generator().manual_seed(0)
    rows, rounds, per_round = 250, 10, 40  # 250 * 10 * 40 = 100,000 draws
    codes, rank = token_codes(VOCAB), torch.arange(8, dtype=torch.int32)
    draws = 0
    for r in range(rounds):
        logits = torch.randn(rows, VOCAB, generator=g) * 3
        best, ids = torch.topk(logits, 8, dim=-1)
        greedy = torch.argmax(logits, dim=-1)
        for i in range(per_round):
            temp = torch.rand(rows, generator=g) * 2 + 0.05
            k = torch.randint(1, 9, (rows,), generator=g, dtype=torch.int32)
            p = torch.rand(rows, generator=g) * 0.9 + 0.1
            seeds = range(draws, draws + rows)
            keys = _keys(seeds, [r * per_round + i] * rows)
            out = sample(logits, greedy, temp, k, p, keys, codes, rank, candidates=True)
            draws += rows
            where = (ids == out[:, None]).to(torch.int64)
            assert bool((where.sum(-1) == 1).all()), "a token outside the 8 best"
            at = where.argmax(-1)
            assert bool((at < k).all()), "a token outside top_k"
            assert bool((out[k == 1] == greedy[k == 1]).all()), "top_k 1 is not greedy"
            scaled = (best.double() / temp.double()[:, None]).masked_fill(
                torch.arange(8)[None, :] >= k[:, None], -math.inf
            )
            probs = torch.softmax(scaled, -1)
            before = (torch.cumsum(probs, -1) - probs).gather(1, at[:, None])[:, 0]
            assert bool((before <= p.double() + 1e-5).all()), "a token outside top_p"
    assert draws >= 100_000


def _transformers_probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits[None, :].clone()
    for warper in (TemperatureLogitsWarper(t), TopKLogitsWarper(k) if k else None,
                   TopPLogitsWarper(p) if p < 1 else None):  # fmt: skip
        if warper is not None:
            scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return torch.softmax(scores.double(), -1)[0]


def _chi2_critical(df: int, z: float = 4.75) -> float:
    """The chi-square value exceeded with probability about 1e-6 (Wilson-Hilferty)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def test_the_distribution_is_transformers_softmax_with_temperature_top_k_top_p() -> None:
    """Seeded draws (over seeds, and over positions of one seed) against transformers'
    processors, on both draws (top_k within the candidates, and the whole vocabulary)."""
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.0, -0.3, -1.0, -2.0, 0.9, 1.45])
    vocab, n = logits.numel(), 40_000
    codes = token_codes(vocab)
    cases = [(0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 8, 0.9), (2.0, 0, 1.0)]
    for t, k, p in cases:
        expected = _transformers_probs(logits, t, k, p) * n
        draw = needs([t], [k])
        assert draw == ("candidates" if 0 < k <= CANDIDATES else "vocabulary")
        rank = torch.arange(vocab, dtype=torch.int32)
        for keys in (_keys(range(n), [17] * n), _keys([5] * n, list(range(n)))):
            out = sample(logits.expand(n, vocab), torch.zeros(n, dtype=torch.int64),
                         torch.full((n,), t), torch.full((n,), k, dtype=torch.int32),
                         torch.full((n,), p), keys, codes, rank,
                         draw == "candidates")  # fmt: skip
            seen = torch.bincount(out, minlength=vocab).double()
            kept = expected > 0
            assert float(seen[~kept].sum()) == 0, (t, k, p, "a removed token was drawn")
            chi2 = float(((seen[kept] - expected[kept]) ** 2 / expected[kept]).sum())
            assert chi2 < _chi2_critical(int(kept.sum()) - 1), (t, k, p, chi2)


def test_an_all_greedy_batch_needs_no_draw() -> None:
    assert needs([0.0, 0.0], [0, 50]) is None
    assert needs([0.7, 0.0], [1, 0]) is None  # top_k 1 is greedy
    assert needs([0.7, 0.0], [50, 0]) == "candidates"
    assert needs([0.7, 0.7], [50, 0]) == "vocabulary"
    assert needs([0.7], [CANDIDATES + 1]) == "vocabulary"
