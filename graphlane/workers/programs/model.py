"""The built-in ``model`` program: the whole decode forward of a Llama-family model,
captured per bucket as one graph over a paged KV cache, with sampling on the device.

This is the graph serving stacks keep hot (vllm-ascend's full-graph decode, torchair,
xLLM): embedding, every layer (RMSNorm, QKV projection, rotary embedding, the new
token's K/V written into the paged cache, fused infer attention over the cache, output
projection, MLP), final norm, LM head, sampling. Per step only the attention's
``actual_seq_lengths_kv`` are patched (each layer's FIA is a task group behind its own
ExternalEvent); tokens, positions, slots, sampling settings and block tables are
copied into static buffers. The architecture and weights come from
:mod:`graphlane.hf_model`; the cache and the ``kv_write``/``kv_read`` operations are those of a
:class:`~.paged_attention.PagedAttentionProgram` the model owns (same layout, same
scratch block for padding rows).

Captured per layer l of a bucket B (T = B rows, one query token each), with the fused
ops of vllm-ascend's Atlas A2 decode layer (docs/models.md has the per-bucket profile)::

    x, residual = npu_add_rms_norm(delta, residual, ln1)       # npu_rms_norm in layer 0
    q, k, v = split(x @ Wqkv + b)
    q, k = npu_rotary_mul(q, cos, sin), npu_rotary_mul(k, cos, sin)   # contiguous
    _npu_reshape_and_cache(k, v, key_cache_l, value_cache_l, slot_mapping)
    ev[l].wait(S); ev[l].reset(S)
    task group: FIA(q_l, key_cache_l, value_cache_l, block_table, TND,
                    actual_seq_lengths=[1..B], actual_seq_lengths_kv=<patched>,
                    out=[attn_l, lse_l])
    x, residual = npu_add_rms_norm(attn_l @ Wo, residual, ln2)
    delta = npu_swiglu(x @ Wgu) @ Wd

then ``logits = lm_head(rms_norm(h)).float()`` and ``tokens = argmax(logits)``. Tail
graphs of each instance (:attr:`GraphProgram.tails`), replayed after it only by the
steps that need them: the draw of sampling rows (:mod:`.sampling`: ``candidates`` over
the top 1024 logits, or ``vocabulary``), and the top-``logprobs`` log-probabilities.

A step: params ``actual_seq_lengths_kv`` (per row, the sequence's length with the token
being fed) and optionally ``temperature``, ``top_k``, ``top_p``, ``seed`` (per row);
inputs ``tokens`` int64 [b] (each row's last token, the one being fed) and
``block_table`` int32 [b, max_blocks_per_seq]. The worker derives each row's position
(length - 1) and slot (where its block table puts that position). Outputs: ``tokens``
int64 [b] (sampled), and only when asked ``logprobs`` float32 [b, K] / ``logprob_ids``
int64 [b, K] (the K most likely tokens' log-probabilities, before temperature) and
``logits`` float32 [b, vocab]. A step's bytes do not grow with the context length.

Decoding ahead (docs/models.md): with ``sequence_id`` (per row, the scheduler's ids), a
row's token may be PREVIOUS (-1): the token its sequence sampled in its last step issued
on this worker (or its prefill, which named the id). A sequence is the client's that
named it (its CURVE key, else its connection: ``Job.owner``). After each step that names
sequences its sampled tokens are copied on the capture stream to a tensor of their own
(:meth:`ModelProgram.issued`); :meth:`ModelProgram.feeds` resolves a PREVIOUS row when
its step is issued, to a copy on the device from there (:class:`~.base.DeviceFeed`,
fenced by stream order), or refuses the step (NO_PREVIOUS_TOKEN) when no such token can
be fed: never a stale one, never another client's.

The sequence operations (``add``, ``decode``, ``append_blocks``, ``free``:
docs/models.md, "Sequences"): each added sequence holds a row of a
:class:`~.batch.PersistentBatch` on the device (its block-table row, its last sampled
token); an ``add`` writes its row, a ``decode`` is planned from the worker's host record
of its sequences (positions, slots, sampling settings), writes its rows' new blocks,
gathers their block-table rows and tokens into the instance's buffers by the rows'
index (:meth:`ModelProgram.feeds`) and scatters its sampled tokens back
(:meth:`ModelProgram.issued`).

``prefill`` (a device-state operation, in order with the replays on the capture
stream): one sequence's prompt ``tokens`` [n] from position ``start`` (0, or the
tokens already in its cache), ``block_table`` [max_blocks_per_seq]; run eagerly in
chunks of ``prefill_chunk`` tokens (causal FIA over the paged cache, sparse_mode 3),
writing every layer's K/V; returns the first sampled token (and logits/logprobs
when asked).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from graphlane.hf_model import (
    ModelSpec,
    load_weights,
    random_weights,
    read_hf_config,
    safetensors_files,
)
from graphlane.protocol.errors import Busy, NoPreviousToken
from graphlane.workers.backends.base import DeviceBackend

from .base import (
    COMPUTE_DTYPES,
    FIA_OUT,
    LENGTHS,
    CapturedGraph,
    DeviceFeed,
    Feed,
    GraphProgram,
    OpCall,
    ProgramConfigError,
    StepError,
    StepPlan,
    check_caps,
    config_values,
)
from .batch import PADDING, PersistentBatch, Sequence
from .paged_attention import (
    PagedAttentionConfig,
    PagedAttentionProgram,
    _check_tensors,
    paged_arguments,
    paged_workspace,
)
from .parallel import (
    Shard,
    TensorParallelGroup,
    check_tensor_parallel,
    local_heads,
    random_shard,
    shard_weights,
)
from .sampling import CANDIDATES, PARAMS, needs, row_keys, sample, sampling_values, token_codes

FIA = "npu_fused_infer_attention_score"
MASK_SIDE = 2048  # the optimised causal mask of sparse_mode 3 (op-plugin document)
OUTPUTS = ("tokens", "logprobs", "logprob_ids", "logits")
SEQUENCE = "sequence_id"  # per row: the scheduler's id of the row's sequence
PREVIOUS = -1  # a row's token: the one its sequence sampled in its previous step
CLIENTS = 1024  # clients of step/prefill sequence_id whose last tokens a worker keeps
_GREEDY = (0.0, 0, 1.0, 0)  # a sequence's sampling settings by default
# a step's, into its buffers (a decode's ints_rows: its ints and persistent-batch rows)
_HOST_INPUTS = ("ints", "ints_rows", "floats", "sampling", "block_table")
_INTS = ("block_size", "num_blocks", "max_blocks_per_seq", "prefill_chunk", "logprobs",
         "max_sequences", "max_sequences_per_client")  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """The ``[[programs]]`` table of a ``model``: ``model`` (a Hugging Face model
    directory) or ``random`` (a config.json's keys, weights drawn with ``seed``)."""

    model: str | None = None
    random: Mapping[str, Any] | None = None
    seed: int = 0
    init_std: float = 0.02
    dtype: str | None = None  # default: the checkpoint's if half precision, else bfloat16
    block_size: int = 128
    num_blocks: int = 64
    max_blocks_per_seq: int = 8
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    prefill_chunk: int = 256
    logprobs: int = 5
    tensor_parallel: int = 1  # ranks the model is split over (docs/models.md)
    max_sequences: int = 4096  # sequences the worker keeps for all its clients together
    max_sequences_per_client: int = 1024  # ... and for one client (a key, or a connection)
    spec: ModelSpec | None = field(default=None, compare=False)  # filled by validate

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str) -> ModelConfig:
        fields = [f for f in cls.__dataclass_fields__ if f != "spec"]
        return cls(**config_values(fields, raw, where)).validated(where)

    def validated(self, where: str = "programs.model") -> ModelConfig:
        """This config with its model's spec read (config.json or ``random``), checked."""
        if (self.model is None) == (self.random is None):
            raise ProgramConfigError(
                f"{where}.model", "name a model directory (model) or a config (random), one"
            )
        if self.model is not None:
            if not isinstance(self.model, str):
                raise ProgramConfigError(f"{where}.model", "must be a directory path")
            raw = read_hf_config(self.model, where)
            safetensors_files(self.model, where)  # present now, not at the first capture
            spec = ModelSpec.from_hf(raw, f"{where}.model")
        else:
            if not isinstance(self.random, Mapping):
                raise ProgramConfigError(f"{where}.random", "must be a table of config keys")
            spec = ModelSpec.from_hf(self.random, f"{where}.random")
        for key in _INTS:
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ProgramConfigError(f"{where}.{key}", f"must be a positive integer, not {v!r}")
        check_caps(self, where)
        if self.logprobs > spec.vocab_size:
            raise ProgramConfigError(
                f"{where}.logprobs", f"must be <= vocab_size {spec.vocab_size}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ProgramConfigError(f"{where}.seed", "must be an integer")
        # As vLLM's dtype "auto": a half-precision checkpoint's own dtype, else bfloat16
        # (the NPU's fused attention takes no float32; float32 is a sim reference, asked
        # for by name)
        half = spec.torch_dtype in ("bfloat16", "float16")
        dtype = self.dtype or (spec.torch_dtype if half else "bfloat16")
        if dtype not in COMPUTE_DTYPES:
            raise ProgramConfigError(f"{where}.dtype", f"must be one of {sorted(COMPUTE_DTYPES)}")
        check_tensor_parallel(spec, self.tensor_parallel, where)
        out = ModelConfig(**{**self.__dict__, "dtype": dtype, "spec": spec})
        out.kv_config().validate(where)
        longest = self.max_blocks_per_seq * self.block_size
        if spec.sliding_window is not None and longest > spec.sliding_window:
            source = "model" if self.model is not None else "random"
            why = " (its default: config.json has no sliding_window)" if spec.window_default else ""
            raise ProgramConfigError(
                f"{where}.{source}.{spec.window_key}",
                f"transformers attends over a window of {spec.sliding_window} tokens{why}"
                " and "
                f"this program serves sequences of up to {longest} (max_blocks_per_seq * "
                "block_size): lower max_blocks_per_seq, or set sliding_window to null in "
                "config.json if the model attends over the whole sequence",
            )
        return out

    def kv_config(self) -> PagedAttentionConfig:
        s = self.spec
        assert s is not None and self.dtype is not None
        heads, kv_heads = local_heads(s, self.tensor_parallel)  # a rank's cache: its KV heads
        return PagedAttentionConfig(
            layers=s.num_layers, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=s.head_dim, block_size=self.block_size, num_blocks=self.num_blocks,
            max_blocks_per_seq=self.max_blocks_per_seq, buckets=tuple(self.buckets),
            dtype=self.dtype,
        )  # fmt: skip


@dataclass(frozen=True)
class _Sampled:
    """Where the token a sequence sampled in its last step is on the device."""

    tokens: torch.Tensor  # that step's sampled tokens, a copy of its own (see issued)
    row: int  # the sequence's row in it
    length: int  # the sequence's length with the token that step fed


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None


class ModelProgram(GraphProgram):
    outputs = OUTPUTS
    batch_param = LENGTHS
    tails = ("candidates", "vocabulary", "logprobs")
    checks_inputs = True
    sequence_ops = True
    inputs_before_first_group = True  # (input_writes)
    step_wide_signature = True  # every layer's: the step's lengths

    def __init__(self, config: ModelConfig | None = None, name: str = "model") -> None:
        config = config or ModelConfig(random={"model_type": "llama"})
        self.config = c = config if config.spec is not None else config.validated()
        assert c.spec is not None and c.dtype is not None
        self.spec = s = c.spec
        self.name = name
        self.kv = PagedAttentionProgram(c.kv_config(), name=name)  # the cache, KV ops
        self.buckets = self.kv.buckets
        self.dtype = COMPUTE_DTYPES[c.dtype]
        self.attention_dtype = c.dtype
        self.max_len = c.max_blocks_per_seq * c.block_size
        self.parameters = {
            LENGTHS: "per row, the sequence's length with the token fed this step, in "
            f"1..{self.max_len} (max_blocks_per_seq * block_size)",
            **PARAMS,
            SEQUENCE: "per row, optional: the scheduler's id of the row's sequence (any "
            f"integer, unique in the step); a row of token {PREVIOUS} is fed the token its "
            "sequence sampled in its previous step, on the device (decoding ahead)",
        }
        self.state_ops = {
            "prefill": "run a prompt's tokens [n] (from position start) through the model "
            "into the cache of its block_table; returns its first sampled token",
            **self.kv.state_ops,
        }
        # A rank's query and KV heads (all of them with one rank; parallel.py)
        self.heads, self.kv_heads = local_heads(s, c.tensor_parallel)
        self._tp: TensorParallelGroup | None = None  # joined when the weights load
        self._shard = Shard(s)  # this rank's part of the model, set with the weights
        self._fia = dict(
            num_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            input_layout="TND",
            scale=s.head_dim**-0.5,  # as transformers scales (not 1 / sqrt: bits differ)
            block_size=c.block_size,
        )
        self._fia_decode = dict(self._fia, softmax_lse_flag=True)  # a decode layer's .out
        self._device: dict[str, Any] | None = None  # weights and tables, see _weights
        top = max(self.buckets)
        # Host values of padding rows: token 0 at position 0 of the scratch block, greedy.
        nb, bs = c.num_blocks, c.block_size
        self._pad_ints = torch.zeros(top, 3, dtype=torch.int64)  # token, pos, slot
        self._pad_ints[:, 2] = nb * bs + torch.arange(top) % bs
        self._pad_floats = torch.tensor([[0.0, 1.0]] * top)  # temperature, top_p
        self._pad_sampling = torch.zeros(top, 3, dtype=torch.int32)  # top_k, row keys
        self._pad_table = torch.full((top, c.max_blocks_per_seq), nb, dtype=torch.int32)
        self._pad_packed = self._pad_ints.flatten().tolist()
        self._q_ends = {b: list(range(1, b + 1)) for b in self.buckets}
        # Decoding ahead: each sequence's last sampled token, by client (Job.owner) and
        # the client's id of it (the issuing thread's alone; a restarted worker starts
        # with none). A client's ids are its own: no other can name its sequences.
        self._clients: OrderedDict[Any, OrderedDict[int, _Sampled]] = OrderedDict()
        self._prefilled: torch.Tensor | None = None  # the last prefill's sampled token
        # Sequence operations (add, decode, append_blocks, free): each client's
        # sequences by its id, as planned (accept order is issue order).
        self._sequences: dict[Any, dict[int, Sequence]] = {}
        # ... and their rows on the device, which a decode patches and gathers (batch.py)
        self._batch = PersistentBatch(c.max_blocks_per_seq, nb, 2 * top)
        # Each instance's FIA arguments but the lengths, by layer (see group_call)
        self._calls: dict[int, tuple[dict[str, torch.Tensor], list[dict[str, Any]]]] = {}

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ModelProgram:
        name = str(raw.get("name", "model"))
        return cls(ModelConfig.from_mapping(raw, f"programs.{name}"), name=name)

    @property
    def num_groups(self) -> int:
        return self.spec.num_layers

    # ------------------------------------------------------------ tensor parallel
    @property
    def tp(self) -> TensorParallelGroup:
        """The ranks this program's model is split over (``tensor_parallel``): the group
        this worker's process initialised, joined at first use (ProgramConfigError if
        there is none of that size)."""
        if self._tp is None:
            self._tp = TensorParallelGroup.join(
                self.config.tensor_parallel, f"programs.{self.name}"
            )
        return self._tp

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def leader(self) -> bool:
        """Whether this rank's outputs go to the client (rank 0; every rank computes
        the same tokens from the same requests)."""
        return self.tp.leader

    def describe(self) -> dict[str, Any]:
        c, s = self.config, self.spec
        kv = self.kv.describe()
        state = dict(kv["state"])
        state["ops"] = {
            "prefill": {
                "tokens": {"shape": ["n"], "dtype": "int64"},
                "block_table": {"shape": [c.max_blocks_per_seq], "dtype": "int32"},
                "start": "int, tokens of the sequence already in the cache (default 0)",
                "params": "temperature, top_k, top_p, seed: one value each",
                "outputs": list(OUTPUTS),
            },
            **state["ops"],
        }
        k = c.logprobs
        return {
            **super().describe(),
            "inputs": {
                "tokens": {"shape": ["batch"], "dtype": "int64"},
                "block_table": {"shape": ["batch", c.max_blocks_per_seq], "dtype": "int32"},
            },
            "output_shapes": {
                "tokens": {"shape": ["batch"], "dtype": "int64"},
                "logprobs": {"shape": ["batch", k], "dtype": "float32"},
                "logprob_ids": {"shape": ["batch", k], "dtype": "int64"},
                "logits": {"shape": ["batch", s.vocab_size], "dtype": "float32"},
            },
            "state": state,
            # the typed sequence operations (docs/models.md, "Sequences")
            "sequence_ops": ["add", "decode", "append_blocks", "free"],
            "config": {
                "model": c.model,
                "random": dict(c.random) if c.random is not None else None,
                "seed": c.seed,
                "init_std": c.init_std,
                **{key: getattr(c, key) for key in _INTS},
                "tensor_parallel": c.tensor_parallel,
                "buckets": list(c.buckets),
                "dtype": c.dtype,
                "architecture": s.describe(),
            },
        }

    # ------------------------------------------------------------ device state
    def _weights(self, backend: DeviceBackend) -> dict[str, Any]:
        """The weights (fused QKV and gate/up), rope tables and constants on the device,
        loaded on first use: once per program and device."""
        if self._device is not None:
            return self._device
        c, s = self.config, self.spec
        tp = self.tp
        self._shard = shard = Shard(s, tp.rank, tp.size)
        where = f"programs.{self.name}"
        if tp.size > 1:  # this rank's part of every tensor, and no more
            host = (shard_weights(s, c.model, self.dtype, shard, where) if c.model is not None
                    else random_shard(s, c.seed, c.init_std, self.dtype, shard))  # fmt: skip
        elif c.model is not None:
            host = load_weights(s, c.model, self.dtype, f"{where}.model")
        else:
            host = random_weights(s, c.seed, c.init_std, self.dtype)

        def dev(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            d = backend.empty(tuple(t.shape), t.dtype)
            d.copy_(t)
            return d

        def cat(*names: str) -> torch.Tensor | None:
            if names[0] not in host:
                return None
            return dev(torch.cat([host[n] for n in names]))

        layers = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(
                _Layer(
                    ln1=dev(host[p + "input_layernorm.weight"]),  # type: ignore[arg-type]
                    ln2=dev(host[p + "post_attention_layernorm.weight"]),  # type: ignore[arg-type]
                    wqkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),  # type: ignore[arg-type]
                    bqkv=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                    wo=dev(host[a + "o_proj.weight"]),  # type: ignore[arg-type]
                    # a row-parallel bias: rank 0 adds it, before the sum (as vLLM)
                    bo=dev(host.get(a + "o_proj.bias")) if tp.leader else None,
                    wgu=cat(m + "gate_proj.weight", m + "up_proj.weight"),  # type: ignore[arg-type]
                    bgu=cat(m + "gate_proj.bias", m + "up_proj.bias"),
                    wd=dev(host[m + "down_proj.weight"]),  # type: ignore[arg-type]
                    bd=dev(host.get(m + "down_proj.bias")) if tp.leader else None,
                )
            )
        embed = dev(host["model.embed_tokens.weight"])
        cos, sin = s.rope_tables(self.max_len, self.dtype)  # [max_len, D] each
        mask = torch.triu(torch.ones(MASK_SIDE, MASK_SIDE, dtype=torch.bool), diagonal=1)
        self._device = {
            "layers": layers,
            "embed": embed,
            "norm": dev(host["model.norm.weight"]),
            "lm_head": embed if s.tie_word_embeddings else dev(host["lm_head.weight"]),
            "cos_sin": dev(torch.cat([cos, sin], dim=-1)),
            # the sampler's static tensors: the token hash's first round, and ranks
            "codes": dev(token_codes(s.vocab_size)),
            "rank": dev(torch.arange(min(CANDIDATES, s.vocab_size), dtype=torch.int32)),
            "rank_vocabulary": dev(torch.arange(s.vocab_size, dtype=torch.int32)),
            "mask": dev(mask),
        }
        return self._device

    # ------------------------------------------------------------ the forward, by parts
    # Each part is the field's Atlas A2 decode layer (vllm-ascend's Llama/Qwen2 path): the
    # residual add fused into the next RMSNorm (npu_add_rms_norm), one QKV matmul, rope
    # by npu_rotary_mul (whose outputs are the contiguous q and k that FIA and the cache
    # write take), the K/V write by _npu_reshape_and_cache, FIA, the output matmul, the
    # gate/up matmul, npu_swiglu, the down matmul. In float32 every fused op computes what
    # transformers computes, in the same order (the sim's kernels; the tests compare
    # tokens).
    def _rope(self, w: dict[str, Any], positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 1, 1, D] of ``positions`` [T]: one gather for the whole forward
        (every layer uses them), from the [max_len, 2 * D] table of cos and sin."""
        d = self.spec.head_dim
        cs = w["cos_sin"].index_select(0, positions)[:, None, None, :]
        return cs[..., :d], cs[..., d:]

    def _norm_in(
        self, b: DeviceBackend, weight: torch.Tensor, delta: torch.Tensor | None,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(RMSNorm of residual + delta, that sum): npu_add_rms_norm, or npu_rms_norm of
        the residual alone (layer 0, whose input is the embedding)."""
        eps = self.spec.rms_norm_eps
        if delta is None:
            return b.call("npu_rms_norm", (residual, weight), {"epsilon": eps})[0], residual
        x, _, total = b.call("npu_add_rms_norm", (delta, residual, weight), {"epsilon": eps})
        return x, total

    def _qkv(
        self, b: DeviceBackend, layer: _Layer, x: torch.Tensor, rope: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, N, D], k and v [T, KV_N, D], contiguous, of normed hidden ``x`` [T, H]."""
        t, d, n, kv = x.shape[0], self.spec.head_dim, self.heads, self.kv_heads
        qkv = F.linear(x, layer.wqkv, layer.bqkv)  # column-parallel: this rank's heads
        q, k, v = qkv.split([n * d, kv * d, kv * d], dim=-1)
        cos, sin = rope
        q = b.call("npu_rotary_mul", (q.view(t, 1, n, d), cos, sin), {})
        k = b.call("npu_rotary_mul", (k.view(t, 1, kv, d), cos, sin), {})
        return q.view(t, n, d), k.view(t, kv, d), v.reshape(t, kv, d).contiguous()

    def _write_kv(
        self, b: DeviceBackend, cache: dict[str, torch.Tensor], layer: int, slots: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor,
    ) -> None:  # fmt: skip
        s = self.spec
        key, value = cache[f"key_cache_{layer}"], cache[f"value_cache_{layer}"]
        nd = (key.shape[0], key.shape[1], self.kv_heads, s.head_dim)  # ND, as FIA's BSH
        b.call("_npu_reshape_and_cache", (k, v, key.view(nd), value.view(nd), slots), {})

    def _mlp(
        self, b: DeviceBackend, layer: _Layer, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection, its residual add (fused into the norm), the MLP: (the
        MLP's output, the residual stream before it)."""
        # o and down are row-parallel: each rank's partial product, summed over the ranks
        o = self.tp.all_reduce(F.linear(attn.reshape(attn.shape[0], -1), layer.wo, layer.bo))
        x, residual = self._norm_in(b, layer.ln2, o, residual)
        act = b.call("npu_swiglu", (F.linear(x, layer.wgu, layer.bgu),), {"dim": -1})
        return self.tp.all_reduce(F.linear(act, layer.wd, layer.bd)), residual

    def _logits(
        self, b: DeviceBackend, w: dict[str, Any], delta: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        x, _ = self._norm_in(b, w["norm"], delta, residual)
        local = F.linear(x, w["lm_head"]).to(torch.float32)  # this rank's part of the vocab
        return self.tp.gather_logits(local, self.spec.vocab_size)

    def _embed(self, w: dict[str, Any], tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``tokens``: a lookup, or with several ranks each rank's
        masked lookup of its part of the vocabulary, summed."""
        return self.tp.embed(tokens, w["embed"], self._shard)

    # ------------------------------------------------------------ capture
    def allocate(self, backend: DeviceBackend, bucket: int) -> dict[str, torch.Tensor]:
        c, s = self.config, self.spec
        self._weights(backend)
        cache = self.kv._state(backend)
        q = (bucket, self.heads, s.head_dim)
        bufs: dict[str, torch.Tensor] = {}
        for layer in range(s.num_layers):
            bufs[f"q_{layer}"] = backend.empty(q, self.dtype)
            bufs[f"attn_{layer}"] = backend.empty(q, self.dtype)
            bufs[f"lse_{layer}"] = backend.empty((bucket, self.heads, 1), torch.float32)
        for t in bufs.values():
            t.zero_()
        # Each row's token, position and slot, then the decode's rows in the persistent
        # batch (batch.py): one buffer, so a decode's host values are one copy.
        bufs["ints_rows"] = backend.empty((4 * bucket,), torch.int64)
        bufs["ints_rows"].zero_()
        bufs["ints"] = bufs["ints_rows"][: 3 * bucket].view(bucket, 3)  # token, pos, slot
        bufs["ints"].copy_(self._pad_ints[:bucket])
        bufs["sampling"] = backend.empty((bucket, 3), torch.int32)  # top_k, row keys
        bufs["sampling"].copy_(self._pad_sampling[:bucket])
        bufs["tokens"] = backend.empty((bucket,), torch.int64)  # greedy, then drawn
        bufs["tokens"].zero_()
        bufs["floats"] = backend.empty((bucket, 2), torch.float32)  # temperature, top_p
        bufs["floats"].copy_(self._pad_floats[:bucket])
        bufs["block_table"] = backend.empty((bucket, c.max_blocks_per_seq), torch.int32)
        bufs["block_table"].copy_(self._pad_table[:bucket])
        bufs.update(cache)
        args = self._arguments(bufs, 0, [self.max_len] * bucket)
        workspace = paged_workspace(backend, args, c.num_blocks, c.max_blocks_per_seq)
        if workspace is not None:
            bufs["workspace"] = workspace
        return bufs

    def _arguments(
        self, bufs: dict[str, torch.Tensor], layer: int, lengths: list[int]
    ) -> dict[str, Any]:
        out = [bufs[f"attn_{layer}"], bufs[f"lse_{layer}"]]
        return paged_arguments(bufs, layer, bufs[f"q_{layer}"], out, self._q_ends[len(lengths)],
                               lengths, self._fia_decode)  # fmt: skip

    def capture(
        self,
        backend: DeviceBackend,
        stream: Any,
        bucket: int,
        buffers: dict[str, torch.Tensor],
        events: list[Any],
    ) -> tuple[list[Any], list[Any]]:
        w = self._weights(backend)
        ints = buffers["ints"]
        tokens, positions, slots = ints[:, 0], ints[:, 1], ints[:, 2]
        lengths = [1] * bucket  # what the buffers hold: every row on the scratch block
        handles = []
        b = backend
        residual, delta = self._embed(w, tokens), None
        rope = self._rope(w, positions)
        for i, layer in enumerate(w["layers"]):
            x, residual = self._norm_in(b, layer.ln1, delta, residual)
            q, k, v = self._qkv(b, layer, x, rope)
            buffers[f"q_{i}"] = q  # FIA's query: a tensor of the graph's pool
            self._write_kv(b, buffers, i, slots, k, v)
            b.wait_external(stream, events[i])  # wait, reset
            b.task_group_begin(stream)
            b.call(FIA_OUT, (), self._arguments(buffers, i, lengths))
            handles.append(b.task_group_end(stream))
            delta, residual = self._mlp(b, layer, buffers[f"attn_{i}"], residual)
        assert delta is not None
        # The logits are the graph's own output (a tensor of its pool, rewritten by every
        # replay); every row's greedy token lands in the static "tokens", which a tail
        # that samples overwrites where rows sample.
        buffers["logits"] = logits = self._logits(b, w, delta, residual)
        torch.argmax(logits, dim=-1, out=buffers["tokens"])
        return handles, [tuple(lengths)] * self.spec.num_layers

    def capture_tail(
        self,
        backend: DeviceBackend,
        stream: Any,
        bucket: int,
        buffers: dict[str, torch.Tensor],
        name: str,
    ) -> None:
        """``candidates`` and ``vocabulary``: the draw of sampling rows (sampling.py);
        ``logprobs``: the top-``logprobs`` log-probabilities."""
        w, logits = self._weights(backend), buffers["logits"]
        if name == "logprobs":
            buffers["logprobs"], buffers["logprob_ids"] = torch.topk(
                torch.log_softmax(logits, dim=-1), self.config.logprobs, dim=-1
            )
            return
        floats, sampling, tokens = buffers["floats"], buffers["sampling"], buffers["tokens"]
        candidates = name == "candidates"
        rank = w["rank"] if candidates else w["rank_vocabulary"]
        tokens.copy_(
            sample(
                logits,
                tokens,
                floats[:, 0],
                sampling[:, 0],
                floats[:, 1],
                sampling[:, 1:],
                w["codes"],
                rank,
                candidates,
            )
        )

    def tails_for(self, plan: StepPlan, outputs: Any) -> list[str]:
        tails = [plan.values["draw"]] if plan.values.get("draw") else []
        if "logprobs" in outputs or "logprob_ids" in outputs:
            tails.append("logprobs")
        return tails

    # ------------------------------------------------------------ steps
    def plan(
        self, batch: int, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]
    ) -> StepPlan:
        c = self.config
        bucket = self.bucket_for(batch)
        for key in params:
            if key != LENGTHS and key != SEQUENCE and key not in PARAMS:
                raise StepError(
                    f"params.{key}", f"unknown parameter (known: {sorted(self.parameters)})"
                )
        lengths = params.get(LENGTHS)
        sequences = self._sequence_ids(params.get(SEQUENCE), batch)
        if not isinstance(lengths, list | tuple) or len(lengths) != batch:
            raise StepError(f"params.{LENGTHS}", f"must be a list of {batch} lengths (one per row)")
        for i, n in enumerate(lengths):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_len:
                raise StepError(
                    f"params.{LENGTHS}[{i}]",
                    f"{n!r} is not a length in 1..{self.max_len} (max_blocks_per_seq * block_size)",
                )
        expected = {
            "tokens": ((batch,), torch.int64),
            "block_table": ((batch, c.max_blocks_per_seq), torch.int32),
        }
        _check_tensors(inputs, expected, "inputs")
        # The host values of a step are a few per row: built as Python lists and made
        # into one tensor each (a torch op on a tiny tensor costs more than its Python).
        toks, table = inputs["tokens"].tolist(), inputs["block_table"]
        ahead = tuple(i for i, t in enumerate(toks) if t == PREVIOUS)
        if ahead:
            if sequences is None:
                raise StepError(
                    "inputs.tokens",
                    f"a token {PREVIOUS} (the token the row's sequence sampled in its "
                    f"previous step) needs params.{SEQUENCE}: which sequence the row is",
                )
            toks = [0 if t == PREVIOUS else t for t in toks]  # fed on the device
        v = self.spec.vocab_size
        if any(t < 0 or t >= v for t in toks):
            raise StepError("inputs.tokens", f"token ids must be in 0..{v - 1} (vocab_size)")
        pos = [n - 1 for n in lengths]
        slots = self._row_slots(table.tolist(), pos)
        if len(set(slots)) != batch:
            raise StepError(
                "inputs.block_table",
                "two rows write one slot (their block tables share the block of their "
                "new tokens): its value would be ambiguous",
            )
        temp, top_k, top_p, seed = sampling_values(params, batch, "params", self.spec.vocab_size)
        rows = (toks, pos, slots, lengths, temp, top_k, top_p, seed)
        return self._build(batch, bucket, rows, sequences, ahead, table)

    def _build(
        self, batch: int, bucket: int, rows: tuple[Any, ...], sequences: Any,
        ahead: tuple[int, ...], table: torch.Tensor,
    ) -> StepPlan:  # fmt: skip
        """A validated step's plan from its rows' values (lists: token, position, slot,
        length, temperature, top_k, top_p, seed) and block table [batch, max_blocks]."""
        toks, pos, slots, lengths, temp, top_k, top_p, seed = rows
        ints = self._pad_ints[:bucket].clone()
        ints[:batch] = torch.tensor(list(zip(toks, pos, slots, strict=True)))
        floats = self._pad_floats[:bucket].clone()
        floats[:batch] = torch.tensor(list(zip(temp, top_p, strict=True)), dtype=torch.float32)
        draw = needs(temp, top_k)
        sampling = self._pad_sampling[:bucket].clone()
        if draw:  # each row's keys: a hash of its seed and the position it samples
            sampling[:batch] = torch.tensor(
                [(k, *row_keys(sd, p + 1)) for k, sd, p in zip(top_k, seed, pos, strict=True)],
                dtype=torch.int32,
            )
        full_table = self._pad_table[:bucket].clone()
        full_table[:batch] = table
        padded = tuple(lengths) + (1,) * (bucket - batch)
        host = {"ints": ints, "floats": floats, "sampling": sampling, "block_table": full_table}
        values = {"lengths": padded, "sequences": sequences, "ahead": ahead, "draw": draw}
        return StepPlan(self.name, batch, bucket, values, host)

    def _sequence_ids(self, ids: Any, rows: int, where: str = f"params.{SEQUENCE}") -> Any:
        """A step's (``rows`` ids) or a prefill's (one, ``rows`` 0) sequence ids; None
        when not given; StepError naming the parameter otherwise."""
        if ids is None:
            return None
        many = ids if rows else [ids]
        if not isinstance(many, list | tuple) or len(many) != max(rows, 1):
            raise StepError(where, f"must be a list of {rows} ids (one per row)")
        for i, sid in enumerate(many):
            if isinstance(sid, bool) or not isinstance(sid, int):
                raise StepError(f"{where}[{i}]" if rows else where, f"{sid!r} is not an integer")
        if len(set(many)) != len(many):
            raise StepError(where, "two rows name one sequence")
        return tuple(many) if rows else many[0]

    # ------------------------------------------------------------ sequence operations
    def plan_sequences(self, op: str, fields: Mapping[str, Any], owner: Any) -> StepPlan:
        """``add``: a prefill that names the sequence, which the worker keeps; ``decode``:
        a step of one row per sequence, each fed its last token on the device, its row
        built here from what the worker keeps (blocks, length, sampling settings)."""
        if op == "add":
            return self._plan_add(fields, owner)
        return self._plan_decode(fields, owner)

    def _table(self, blocks: list[int]) -> torch.Tensor:
        """A block-table row of ``blocks`` (checked: :meth:`_check_blocks`), the scratch
        block past them."""
        c = self.config
        pad = [c.num_blocks] * (c.max_blocks_per_seq - len(blocks))
        return torch.tensor(blocks + pad, dtype=torch.int32)

    def _plan_add(self, fields: Mapping[str, Any], owner: Any) -> StepPlan:
        sid, blocks = fields["sequence"], list(fields["blocks"])
        params = dict(fields.get("params") or {})
        for key in params:  # (its prefill's check would list sequence_id, refused here)
            if key not in PARAMS:
                where = " (an add names its sequence in its field sequence)"
                raise StepError(f"params.{key}", f"unknown parameter (known: {sorted(PARAMS)})"
                                + (where if key == SEQUENCE else ""))  # fmt: skip
        mine = self._sequences.get(owner, {})
        if sid in mine:
            raise StepError("sequence", f"sequence {sid} is added already: free it first")
        self._check_room(len(mine))
        self._check_blocks(blocks, "blocks")
        self._check_prompt(fields["tokens"], len(blocks))
        prefill = {
            "tokens": fields["tokens"],
            "block_table": self._table(blocks),
            "params": {**params, SEQUENCE: sid},
            "outputs": fields.get("outputs") or ["tokens"],
        }
        plan = self.plan_state("prefill", prefill)
        temp, top_k, top_p, seed = sampling_values(
            params, 1, "params", self.spec.vocab_size, per_row=False
        )
        sampling = (temp[0], top_k[0], top_p[0], seed[0])
        draw = needs(temp, top_k)
        seq = Sequence(blocks, plan.batch, sampling, draw, self._batch.take_row())
        self._sequences.setdefault(owner, {})[sid] = seq
        return StepPlan(plan.program, plan.batch, plan.bucket, {**plan.values, "added": seq},
                        plan.inputs)  # fmt: skip

    def _check_prompt(self, tokens: Any, blocks: int) -> None:
        """An add's prompt fits the most a sequence holds and the blocks it is given:
        StepError naming the add's own field (its prefill names a ``block_table``)."""
        n = tokens.numel() if isinstance(tokens, torch.Tensor) and tokens.dim() == 1 else 0
        if n > self.max_len:
            raise StepError("tokens", f"a prompt of {n} tokens is longer than {self.max_len}, "
                            "the most (max_blocks_per_seq * block_size)")  # fmt: skip
        bs = self.config.block_size
        if n > blocks * bs:
            raise StepError("blocks", f"a prompt of {n} tokens needs {-(-n // bs)} blocks of "
                            f"{bs} tokens, {blocks} given")  # fmt: skip

    def _check_room(self, mine: int) -> None:
        """Refuse an add past the caps: StepError (BAD_REQUEST) for this client's own,
        Busy for the worker's total (others may free theirs)."""
        c, where = self.config, f"programs.{self.name}"
        if mine >= c.max_sequences_per_client:
            raise StepError("sequence", f"this client holds {mine} sequences of program "
                            f"{self.name!r}, the most ({where}.max_sequences_per_client): "
                            "free some first")  # fmt: skip
        held = sum(map(len, self._sequences.values()))
        if held >= c.max_sequences:
            raise Busy(f"this worker holds {held} sequences of program {self.name!r} for "
                       f"its clients, the most ({where}.max_sequences): free some, or retry "
                       "when other clients have")  # fmt: skip

    def release(self, owner: Any) -> int:
        """Forget every sequence of ``owner`` (a client that went); how many."""
        added = self._sequences.pop(owner, {})
        for seq in added.values():  # (rewritten only by a later add, issued after these)
            self._batch.release_row(seq.row)
        sampled = self._clients.pop(owner, OrderedDict())
        return len(added.keys() | sampled.keys())

    def sequence_counts(self) -> dict[str, int]:
        """The clients with sequences, the sequences added (``add``) and the KV blocks
        they hold, as status reports them."""
        held: set[int] = set()
        for mine in self._sequences.values():
            for seq in mine.values():
                held.update(seq.blocks)
        with_some = {o for o, m in self._sequences.items() if m}  # (one that freed all: none)
        with_some.update(o for o, sampled in self._clients.items() if sampled)
        return {
            "clients": len(with_some),
            "sequences": sum(map(len, self._sequences.values())),
            "blocks_held": len(held),
            "blocks_free": self.config.num_blocks - len(held),
        }

    def _plan_decode(self, fields: Mapping[str, Any], owner: Any) -> StepPlan:
        """A decode's step, its rows' values straight from the worker's record (checked
        when added or appended): a few numbers per row, and the index of the rows in the
        persistent batch that its block-table rows and tokens are gathered by (feeds)."""
        sids, new = fields["sequences"], fields.get("new_blocks")
        batch = len(sids)
        top = self.buckets[-1]
        if batch > top:  # (bucket_for would name "batch", no field of decode)
            raise StepError("sequences", f"{batch} sequences, more than the largest captured "
                            f"bucket {top}: decode at most that many per step")  # fmt: skip
        bucket = self.bucket_for(batch)
        mine = self._sequences.get(owner) or {}
        rows = [mine.get(sid) for sid in sids]
        if None in rows:
            i = rows.index(None)
            raise StepError(f"sequences[{i}]", f"sequence {sids[i]} is not one this client "
                            "added (or it was freed): add it first")  # fmt: skip
        if len(set(sids)) != batch:
            raise StepError("sequences", "two rows name one sequence")
        if new:
            for sid in new:
                if sid not in sids:
                    raise StepError(f"new_blocks.{sid}", f"sequence {sid} is not decoded here")
                self._check_blocks(mine[sid].blocks + list(new[sid]), f"new_blocks.{sid}")
        bs = self.config.block_size
        packed: list[int] = []  # per row: token (fed on the device), position, slot
        lengths: list[int] = []
        draw: str | None = None
        for i, seq in enumerate(rows):
            assert seq is not None
            p = seq.length  # the new token's position
            k, offset = divmod(p, bs)
            blocks = seq.blocks if not new or sids[i] not in new else seq.blocks + new[sids[i]]
            if k >= len(blocks):
                raise self._no_room(i, sids[i], p, len(blocks))
            packed += (0, p, blocks[k] * bs + offset)
            lengths.append(p + 1)
            if seq.draw is not None and draw != "vocabulary":
                draw = seq.draw
        if len(set(packed[2::3])) != batch:
            raise StepError("sequences", "two sequences write one slot (they share the block "
                            "of their new tokens): its value would be ambiguous")  # fmt: skip
        if new:  # checked: the record takes them (written to the rows when issued)
            for sid, more in new.items():
                mine[sid].blocks += more
        return self._build_rows(batch, bucket, packed, lengths, rows, draw)  # type: ignore[arg-type]

    def _no_room(self, i: int, sid: int, p: int, blocks: int) -> StepError:
        if p >= self.max_len:
            return StepError(f"sequences[{i}]", f"sequence {sid} is {p} tokens long: "
                             f"{self.max_len} is the most (max_blocks_per_seq * block_size); "
                             "free it")  # fmt: skip
        return StepError(f"sequences[{i}]", f"sequence {sid}'s {blocks} blocks hold no "
                         f"token {p + 1}: send new_blocks")  # fmt: skip

    def _build_rows(
        self, batch: int, bucket: int, packed: list[int], lengths: list[int],
        rows: list[Sequence], draw: str | None,
    ) -> StepPlan:  # fmt: skip
        """A decode's plan (its rows' records move on): one host tensor (``ints_rows``,
        one copy) of the rows' values (token placeholder, position, slot) and the
        bucket's padding rows, then the rows' index in the persistent batch (padded with
        its padding row); the sampling settings only when a row draws."""
        pad = bucket - batch
        packed += self._pad_packed[: 3 * pad]
        packed += [q.row for q in rows]
        packed += [PADDING] * pad
        # (4x torch.tensor's speed; a view or a slice of it would cost what it does)
        inputs = {"ints_rows": torch.frombuffer(array("q", packed), dtype=torch.int64)}
        if draw:  # only the draw reads them (an all-greedy step replays no tail)
            sampling = [q.sampling for q in rows]
            inputs["floats"] = torch.tensor(
                [(t, p) for t, _, p, _ in sampling] + [(0.0, 1.0)] * pad, dtype=torch.float32
            )
            keys = [(k, *row_keys(sd, n))
                    for (_, k, _, sd), n in zip(sampling, lengths, strict=True)]  # fmt: skip
            inputs["sampling"] = torch.tensor(keys + [(0, 0, 0)] * pad, dtype=torch.int32)
        for q in rows:
            q.length += 1
        kv = lengths + [1] * pad
        values = {"lengths": tuple(kv), "kv": kv, "draw": draw, "decoded": rows}
        return StepPlan(self.name, batch, bucket, values, inputs)

    def _check_blocks(self, blocks: list[int], where: str) -> None:
        c = self.config
        nb = c.num_blocks
        if any(b < 0 or b >= nb for b in blocks):
            raise StepError(where, f"blocks must be in 0..{nb - 1} (num_blocks)")
        if len(blocks) > c.max_blocks_per_seq:
            raise StepError(where, f"{len(blocks)} blocks, more than max_blocks_per_seq "
                            f"{c.max_blocks_per_seq}")  # fmt: skip

    def sequence_change(self, op: str, fields: Mapping[str, Any], owner: Any) -> dict[str, Any]:
        mine = self._sequences.get(owner, {})
        if op == "free":
            # (its row is written again only by a later add, issued after the steps
            # already planned for it)
            freed = []
            for sid in fields["sequences"]:
                seq = mine.pop(sid, None)
                if seq is not None:
                    self._batch.release_row(seq.row)
                    freed.append(sid)
            return {"freed": freed}
        sid, blocks = fields["sequence"], list(fields["blocks"])
        seq = mine.get(sid)
        if seq is None:
            raise StepError("sequence", f"sequence {sid} is not one this client added")
        self._check_blocks(seq.blocks + blocks, "blocks")
        seq.blocks += blocks  # written to its row by the next decode that needs them
        return {"blocks": len(seq.blocks)}

    # ------------------------------------------------------------ decoding ahead
    #: check_feeds raises every refusal of feeds (the engine's patches go first)
    checks_feeds_first = True

    def check_feeds(self, plan: StepPlan, owner: Any = None) -> None:
        decoded = plan.values.get("decoded")
        if decoded is not None:
            self._batch.check(decoded, plan.values["kv"])
        else:
            self._ahead_records(plan, owner)

    def feeds(self, plan: StepPlan, owner: Any = None, checked: bool = False) -> list[Feed]:
        """A decode's rows from the persistent batch (batch.py): its rows' new blocks
        written, their block-table rows and last tokens gathered by its index straight
        into the step's buffers, on the capture stream. A generic step's rows of token
        PREVIOUS: the token its sequence sampled in its previous step, from that step's
        copy of its tokens on the device. NoPreviousToken when there is no such token to
        feed (:meth:`check_feeds`). Runs in issue order, so "previous" is the sequence's
        last step issued before this one. A sequence is ``owner``'s (the client that
        named it): another client's same id is another sequence."""
        decoded = plan.values.get("decoded")
        if decoded is not None:
            b = self._batch
            b.prepare(decoded, plan.values["kv"], checked)
            return [b.feed]
        feeds: list[Feed] = []
        run: list[Any] = []  # [first row, its record, rows so far]: one copy per run
        for i, rec in self._ahead_records(plan, owner):
            if (
                run
                and run[1].tokens is rec.tokens
                and (run[1].row + run[2] == rec.row and run[0] + run[2] == i)
            ):
                run[2] += 1
                continue
            if run:
                feeds.append(self._feed(*run))
            run = [i, rec, 1]
        if run:
            feeds.append(self._feed(*run))
        return feeds

    def _ahead_records(self, plan: StepPlan, owner: Any) -> list[tuple[int, _Sampled]]:
        """A generic step's rows of token PREVIOUS, each with the record of its sequence's
        last step (``owner``'s); NoPreviousToken for a row that has none to feed."""
        ahead = plan.values.get("ahead")
        if not ahead:
            return []
        sequences, lengths = plan.values["sequences"], plan.values["lengths"]
        mine: Mapping[int, _Sampled] = self._clients.get(owner) or {}
        out = []
        for i in ahead:
            sid, n = sequences[i], lengths[i]
            rec = mine.get(sid)
            if rec is None:
                raise NoPreviousToken(
                    f"row {i}: sequence {sid} has no step on this worker from this client "
                    "to take its token from (its steps were refused or failed, or ran on a "
                    "worker that has restarted since, or on another connection, or it is "
                    "long gone); send the token itself"
                )
            if rec.length + 1 != n:
                raise NoPreviousToken(
                    f"row {i}: sequence {sid}'s last step on this worker fed length "
                    f"{rec.length}, so this row would be length {rec.length + 1}, not {n}: "
                    "the step in between was refused, failed, timed out or was not sent; "
                    "send the token itself"
                )
            out.append((i, rec))
        return out

    @staticmethod
    def _feed(row: int, rec: _Sampled, rows: int) -> DeviceFeed:
        source = rec.tokens[rec.row : rec.row + rows]
        return DeviceFeed(source, "ints", (slice(row, row + rows), 0))

    def _client(self, owner: Any) -> OrderedDict[int, _Sampled]:
        """``owner``'s record of sampled tokens, made the most recently active; past
        CLIENTS clients the least recently active one's go, its sequences' rows freed."""
        clients = self._clients
        sampled = clients.get(owner)
        if sampled is None:
            sampled = clients[owner] = OrderedDict()
            if len(clients) > CLIENTS:
                self._forget_a_client(owner)
        clients.move_to_end(owner)
        return sampled

    def issued(
        self, plan: StepPlan, graph: CapturedGraph | None, done: Any, owner: Any = None
    ) -> None:
        """Keep each sequence's sampled token where its next step takes it from: a
        decode's and an add's in the persistent batch; a generic step's or a prefill's
        that named sequences, for ``owner``, in a copy of that step's tokens."""
        values = plan.values
        if graph is not None and "decoded" in values:
            self._batch.commit(values["decoded"], values["lengths"], graph.buffers)
            return
        named = values.get("sequences") if graph is not None else values.get("sequence")
        if named is None:
            self._prefilled = None
            return
        sampled = self._client(owner)
        if graph is not None:
            # A copy of the rows' tokens, on the capture stream behind the step (the
            # engine's): the instance's buffer is rewritten by its next replay, which
            # may be any client's step, while a sequence may sit steps out.
            tokens = graph.buffers["tokens"][: plan.batch].clone()
            lengths = values["lengths"]
            for i, sid in enumerate(named):
                sampled[sid] = _Sampled(tokens, i, lengths[i])
                sampled.move_to_end(sid)
        else:  # a prefill that named its sequence (an add's: its row takes the token)
            token = self._prefilled
            assert token is not None
            length = values["start"] + plan.batch
            added = values.get("added")
            if added is not None:
                if self._batch.last is not None:  # (None: planned and issued, no device)
                    self._batch.set_token(added, token, length)
            else:
                sampled[named] = _Sampled(token, 0, length)
                sampled.move_to_end(named)
        self._prefilled = None
        # A client's sequences of step/prefill sequence_id, the most recently stepped
        # (its added ones are capped when added, and never forgotten while it is here).
        extra = len(sampled) - self.config.max_sequences_per_client
        if extra > 0:
            added = self._sequences.get(owner) or {}
            for sid in [sid for sid in sampled if sid not in added][:extra]:
                del sampled[sid]

    def _forget_a_client(self, newest: Any) -> None:
        """Past CLIENTS clients of step/prefill ``sequence_id``: the least recently
        active one without added sequences (those are capped and released when their
        client goes) loses its last tokens (its next row of token -1:
        NO_PREVIOUS_TOKEN)."""
        for owner in self._clients:
            if owner not in self._sequences and owner != newest:
                del self._clients[owner]
                return

    def _check_tokens(self, tokens: torch.Tensor, where: str) -> None:
        v = self.spec.vocab_size
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v):
            raise StepError(where, f"token ids must be in 0..{v - 1} (vocab_size)")

    def _row_slots(self, table: list[list[int]], pos: list[int]) -> list[int]:
        """:meth:`_slots` of a decode step, over lists (one position per row)."""
        c = self.config
        bs, nb = c.block_size, c.num_blocks
        slots = []
        for i, p in enumerate(pos):
            used = table[i][: p // bs + 1]
            if min(used) < 0 or max(used) >= nb:
                raise StepError(
                    f"inputs.block_table[{i}]",
                    f"the {len(used)} blocks a length of {p + 1} reads must be in 0..{nb - 1}",
                )
            slots.append(used[-1] * bs + p % bs)
        return slots

    def _slots(self, table: torch.Tensor, pos: torch.Tensor, lengths: Any) -> torch.Tensor:
        """Each position's slot through its row's block table [rows, max_blocks] (``pos``
        [rows]); StepError when a block a row reads is not the scheduler's."""
        c = self.config
        for i, n in enumerate(lengths):
            used = table[i, : -(-n // c.block_size)]
            if int(used.min()) < 0 or int(used.max()) >= c.num_blocks:
                raise StepError(
                    f"inputs.block_table[{i}]",
                    f"the {len(used)} blocks a length of {n} reads must be in "
                    f"0..{c.num_blocks - 1}",
                )
        rows = torch.arange(table.shape[0])
        blocks = table[rows, pos // c.block_size].to(torch.int64)
        return blocks * c.block_size + pos % c.block_size

    def group_signature(self, plan: StepPlan, group: int) -> Any:
        return plan.values["lengths"]

    def group_call(self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int) -> OpCall:
        # (the in-process loops call it per layer: no more calls than it needs)
        cached = self._calls.get(id(buffers))
        layer = (cached[1] if cached is not None else self._layers(buffers, plan))[group]
        lengths = plan.values.get("kv")
        if lengths is None:
            lengths = list(plan.values["lengths"])
        return FIA_OUT, (), {**layer, LENGTHS: lengths}

    def group_calls(self, buffers: dict[str, torch.Tensor], plan: StepPlan) -> list[OpCall]:
        lengths = _kv(plan)  # one list per step, every layer's
        return [(FIA_OUT, (), {**layer, LENGTHS: lengths}) for layer in self._layers(buffers, plan)]

    def _layers(self, buffers: dict[str, torch.Tensor], plan: StepPlan) -> list[dict[str, Any]]:
        """Each layer's arguments but the lengths: the instance's for good, made once; each
        patch takes a copy with its step's lengths."""
        cached = self._calls.get(id(buffers))
        if cached is None:
            bucket = [1] * plan.bucket
            layers = [self._arguments(buffers, i, bucket) for i in range(self.num_groups)]
            cached = self._calls[id(buffers)] = (buffers, layers)
        return cached[1]

    def input_writes(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, group: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if group:  # everything lands before layer 0 (a few copies, padding rows included)
            return []
        inputs = plan.inputs
        return [(buffers[k], inputs[k]) for k in _HOST_INPUTS if k in inputs]

    def output_views(
        self, buffers: dict[str, torch.Tensor], plan: StepPlan, names: list[str]
    ) -> dict[str, torch.Tensor]:
        n = plan.batch
        tokens = self._batch.views(buffers).tokens  # (made once per instance)
        return {k: tokens[n] if k == "tokens" else buffers[k][:n] for k in names}

    # ------------------------------------------------------------ device-state operations
    def plan_state(self, op: str, fields: Mapping[str, Any]) -> StepPlan:
        if op != "prefill" and self.config.tensor_parallel > 1:
            raise StepError(
                "op",
                f"{op} addresses one rank's KV heads, and every rank of this model's group "
                f"gets the same request (tensor_parallel {self.config.tensor_parallel}): "
                "use prefill or add, which write each rank's own",
            )
        if op != "prefill":
            return self.kv.plan_state(op, fields)
        c = self.config
        tokens, table = fields.get("tokens"), fields.get("block_table")
        start = fields.get("start", 0)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() < 1:
            raise StepError("tokens", "must be a 1-D int64 or int32 tensor of at least one token")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise StepError("tokens", f"dtype {tokens.dtype} instead of int64 or int32")
        tokens = tokens.to(torch.int64)
        self._check_tokens(tokens, "tokens")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise StepError("start", f"{start!r} is not an integer >= 0")
        n = tokens.numel()
        if start + n > self.max_len:
            raise StepError(
                "tokens",
                f"start {start} + {n} tokens exceeds {self.max_len} "
                "(max_blocks_per_seq * block_size)",
            )
        _check_tensors(
            {"block_table": table}, {"block_table": ((c.max_blocks_per_seq,), torch.int32)}, ""
        )
        assert isinstance(table, torch.Tensor)
        pos = torch.arange(start, start + n, dtype=torch.int64)
        try:  # the blocks of the last position: every block the prompt reads
            self._slots(table.reshape(1, -1), pos[-1:], [start + n])
        except StepError as exc:
            raise StepError("block_table", str(exc).split(": ", 1)[-1]) from None
        blocks = table[pos // c.block_size].to(torch.int64)
        slots = blocks * c.block_size + pos % c.block_size
        names = fields.get("outputs") or ["tokens"]
        for name in names:
            if name not in OUTPUTS:
                raise StepError("outputs", f"unknown output {name!r} (known: {list(OUTPUTS)})")
        if len(set(names)) != len(names):
            raise StepError("outputs", f"names must be unique, got {list(names)}")
        prefill_params = fields.get("params") or {}
        for key in prefill_params:
            if key != SEQUENCE and key not in PARAMS:
                raise StepError(
                    f"params.{key}", f"unknown parameter (known: {sorted([*PARAMS, SEQUENCE])})"
                )
        sequence = self._sequence_ids(prefill_params.get(SEQUENCE), 0, f"params.{SEQUENCE}")
        temp, top_k, top_p, seed = sampling_values(
            prefill_params, 1, "params", self.spec.vocab_size, per_row=False
        )
        sampling = {
            "temperature": torch.tensor(temp, dtype=torch.float32),
            "top_p": torch.tensor(top_p, dtype=torch.float32),
            "sampling": torch.tensor(
                [[top_k[0], *row_keys(seed[0], start + n)]], dtype=torch.int32
            ),
        }
        inputs = {
            "tokens": tokens,
            "positions": pos,
            "slots": slots,
            "block_table": table,
            **sampling,
        }
        values = {"op": op, "start": start, "outputs": tuple(names), "sequence": sequence,
                  "draw": needs(temp, top_k)}  # fmt: skip
        return StepPlan(self.name, n, 0, values, inputs)

    def run_state(self, backend: DeviceBackend, plan: StepPlan) -> dict[str, torch.Tensor]:
        if plan.values["op"] != "prefill":
            return self.kv.run_state(backend, plan)
        added = plan.values.get("added")
        if added is not None:  # an add: its row in the persistent batch, written first
            self._batch.bind(backend)
            self._batch.join(added)
        return self._prefill(backend, plan)

    def _prefill(self, backend: DeviceBackend, plan: StepPlan) -> dict[str, torch.Tensor]:
        c = self.config
        w = self._weights(backend)
        cache = self.kv._state(backend)
        host = plan.inputs

        def dev(t: torch.Tensor) -> torch.Tensor:
            d = backend.empty(tuple(t.shape), t.dtype)
            backend.copy_in(d, t)
            return d

        tokens, positions, slots = dev(host["tokens"]), dev(host["positions"]), dev(host["slots"])
        table = dev(host["block_table"].reshape(1, -1))
        start, n = plan.values["start"], plan.batch
        b = backend
        delta: torch.Tensor | None = None
        for c0 in range(0, n, c.prefill_chunk):
            c1 = min(n, c0 + c.prefill_chunk)
            residual, delta = self._embed(w, tokens[c0:c1]), None
            rope = self._rope(w, positions[c0:c1])
            for i, layer in enumerate(w["layers"]):
                x, residual = self._norm_in(b, layer.ln1, delta, residual)
                q, k, v = self._qkv(b, layer, x, rope)
                self._write_kv(b, cache, i, slots[c0:c1], k, v)
                attn, _ = backend.call(
                    FIA,
                    (),
                    dict(
                        query=q,
                        key=cache[f"key_cache_{i}"],
                        value=cache[f"value_cache_{i}"],
                        block_table=table,
                        atten_mask=w["mask"],
                        sparse_mode=3,
                        actual_seq_lengths=[c1 - c0],
                        actual_seq_lengths_kv=[start + c1],
                        **self._fia,
                    ),
                )
                delta, residual = self._mlp(b, layer, attn, residual)
        assert delta is not None
        logits = self._logits(b, w, delta[-1:], residual[-1:])
        out: dict[str, torch.Tensor] = {}
        names = plan.values["outputs"]
        if "tokens" in names or plan.values["sequence"] is not None:
            tokens = torch.argmax(logits, dim=-1)
            draw = plan.values["draw"]
            if draw:
                sp = dev(host["sampling"])
                rank = w["rank"] if draw == "candidates" else w["rank_vocabulary"]
                tokens = sample(logits, tokens, dev(host["temperature"]), sp[:, 0],
                                dev(host["top_p"]), sp[:, 1:], w["codes"], rank,
                                draw == "candidates")  # fmt: skip
            out["tokens"] = self._prefilled = tokens
        if "logits" in names:
            out["logits"] = logits
        if "logprobs" in names or "logprob_ids" in names:
            lp, ids = torch.topk(torch.log_softmax(logits, dim=-1), c.logprobs, dim=-1)
            out |= {"logprobs": lp, "logprob_ids": ids}
        return {k: out[k] for k in names}


def _kv(plan: StepPlan) -> list[int]:
    """A step's lengths as its patches name them (a decode's list, made once per step)."""
    lengths = plan.values.get("kv")
    return lengths if lengths is not None else list(plan.values["lengths"])


__all__ = ["PREVIOUS", "SEQUENCE", "ModelConfig", "ModelProgram"]
