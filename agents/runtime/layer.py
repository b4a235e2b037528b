"""One MoE transformer layer, executed across ranks under a plan, and its reference.

Data flow on rank r (``T_r`` tokens, its attention share of the step)::

    attention phase  a = x + Attn(x)            GQA projections + SDPA (flash backend on GPU)
                     s = SharedFFN(a)           shared expert(s), every token
                     (idx, w) = topk(softmax(a @ W_router))       top-k experts per token
    dispatch         each (token, expert) pair -> the GPU of the chosen replica of that
                     expert: replicas split an expert's pairs by their plan shares; pairs go
                     out with all_to_all_single (FP8 with one scale per 128 values when the
                     plan asks for FP8 dispatch, else the compute dtype)
    experts          grouped GEMM per local slot: y = W2 (silu(W1 a) * W3 a)
    combine          results return with all_to_all_single in the compute dtype
    output           out = a + s + sum_k w_k * y_k   (token-major, one batched GEMM)

Tensors: ``x`` is ``[tokens, hidden]``; decode keeps one sequence per token with a KV cache
``[tokens, kv_heads, context, head_dim]`` whose last position receives the new token's keys
and values; prefill splits a rank's tokens into causal sequences of ``seq_len`` tokens.

Everything is torch (imported by this module: install ``mixfleet[gpu]``); with ``world ==
1`` and no process group the same code runs in one process, which is how
:func:`reference_forward` checks the distributed result.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as nnf

from agents.runtime.routing import (
    RankPlacement,
    RoutingTables,
    assign_replicas,
    fp8_pack,
    fp8_roundtrip,
    fp8_unpack,
)
from policies.model.architecture import ModelSpec

Tensor = Any  # torch.Tensor; torch is untyped for mypy here


@dataclass(frozen=True)
class LayerShape:
    """Dimensions of the layer (elements).

    Attributes:
        hidden: model width.
        num_experts: routed experts.
        top_k: routed experts per token.
        expert_ffn: intermediate size of one routed expert.
        num_shared_experts: shared experts (each ``expert_ffn`` wide) every token runs.
        num_q_heads, num_kv_heads, head_dim: GQA attention shape.
    """

    hidden: int
    num_experts: int
    top_k: int
    expert_ffn: int
    num_shared_experts: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_model(cls, model: ModelSpec) -> LayerShape:
        """The MoE layer of ``model`` (GQA attention; MLA models are run as GQA with one
        KV head and their q/k head dim)."""
        return cls(
            hidden=model.hidden,
            num_experts=model.num_experts,
            top_k=model.top_k,
            expert_ffn=model.expert_ffn,
            num_shared_experts=model.num_shared_experts,
            num_q_heads=model.num_q_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
        )


# ------------------------------------------------------------------------------ weights


@dataclass
class LayerWeights:
    """Weights one rank holds.

    Attributes:
        wq, wk, wv: ``[hidden, heads * head_dim]`` projections; wo ``[q_heads * head_dim,
            hidden]``.
        w_router: ``[hidden, num_experts]`` in float32.
        shared_w13: ``[hidden, 2 * shared_ffn]`` (gate and up); shared_w2 ``[shared_ffn,
            hidden]``; None without shared experts.
        w13: ``[slots, 2 * expert_ffn, hidden]`` gate and up of the local expert slots;
            w2 ``[slots, hidden, expert_ffn]`` down.
    """

    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    w_router: Tensor
    shared_w13: Tensor | None
    shared_w2: Tensor | None
    w13: Tensor
    w2: Tensor


def _randn(shape: Sequence[int], seed: int, scale: float, device: Any, dtype: Any) -> Tensor:
    """Seeded normal values (drawn on the CPU in float32 so every rank gets the same)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def make_weights(
    shape: LayerShape,
    experts: Sequence[int],
    *,
    device: Any,
    dtype: Any,
    seed: int = 0,
    seeded_experts: bool = True,
) -> LayerWeights:
    """Weights of one rank: attention, router and shared expert (the same on every rank)
    and the routed experts ``experts`` (one slot each, in slot order).

    With ``seeded_experts`` every expert's weights come from a seed of its own (any rank,
    any slot order gives the same expert: what the distributed-vs-reference test needs);
    otherwise they are drawn on the device, which is fast for large benchmarks.
    """
    h, d = shape.hidden, shape.head_dim
    qd, kvd = shape.num_q_heads * d, shape.num_kv_heads * d
    f = shape.expert_ffn
    fs = f * shape.num_shared_experts
    s_in = 1.0 / math.sqrt(h)
    w = LayerWeights(
        wq=_randn((h, qd), seed + 1, s_in, device, dtype),
        wk=_randn((h, kvd), seed + 2, s_in, device, dtype),
        wv=_randn((h, kvd), seed + 3, s_in, device, dtype),
        wo=_randn((qd, h), seed + 4, 1.0 / math.sqrt(qd), device, dtype),
        w_router=_randn((h, shape.num_experts), seed + 5, s_in, device, torch.float32),
        shared_w13=_randn((h, 2 * fs), seed + 6, s_in, device, dtype) if fs else None,
        shared_w2=_randn((fs, h), seed + 7, 1.0 / math.sqrt(fs), device, dtype) if fs else None,
        w13=torch.empty((len(experts), 2 * f, h), device=device, dtype=dtype),
        w2=torch.empty((len(experts), h, f), device=device, dtype=dtype),
    )
    for slot, e in enumerate(experts):
        if seeded_experts:
            w.w13[slot] = _randn((2 * f, h), 1000 + 2 * e + seed * 100003, s_in, device, dtype)
            w.w2[slot] = _randn((h, f), 1001 + 2 * e + seed * 100003, f**-0.5, device, dtype)
    if not seeded_experts and len(experts):
        w.w13.normal_(0.0, s_in)
        w.w2.normal_(0.0, f**-0.5)
    return w


def make_kv_cache(
    shape: LayerShape, sequences: int, context: int, *, device: Any, dtype: Any, seed: int
) -> tuple[Tensor, Tensor]:
    """Decode KV cache ``[sequences, kv_heads, context, head_dim]`` for keys and values."""
    dims = (sequences, shape.num_kv_heads, context, shape.head_dim)
    if device == "cpu" or getattr(device, "type", "") == "cpu":
        return (
            _randn(dims, seed + 11, 1.0, device, dtype),
            _randn(dims, seed + 12, 1.0, device, dtype),
        )
    k = torch.randn(dims, device=device, dtype=dtype)
    v = torch.randn(dims, device=device, dtype=dtype)
    return k, v


# ---------------------------------------------------------------------------- attention


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
    """Scaled dot-product attention with grouped KV heads; flash backend on CUDA."""
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return nnf.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    if gqa:  # the CPU kernels need as many KV heads as query heads
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return nnf.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attention(
    x: Tensor,
    w: LayerWeights,
    shape: LayerShape,
    *,
    decode: bool,
    seq_len: int,
    kv_cache: tuple[Tensor, Tensor] | None,
) -> Tensor:
    """Attention output (before the residual) for ``x`` ``[tokens, hidden]``.

    Decode: token t is the newest token of sequence t; its keys and values are written
    into the last cache position and it attends over the whole cache. Prefill: tokens
    form causal sequences of ``seq_len`` (the last one shorter when needed).
    """
    t = x.shape[0]
    if t == 0:
        return x.new_zeros((0, shape.hidden))
    nq, nkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    q = x @ w.wq
    k = x @ w.wk
    v = x @ w.wv
    if decode:
        if kv_cache is None:
            raise ValueError("decode attention needs a KV cache")
        kc, vc = kv_cache
        kc[:, :, -1] = k.view(t, nkv, d)
        vc[:, :, -1] = v.view(t, nkv, d)
        o = sdpa(q.view(t, nq, 1, d), kc, vc, causal=False)
        return o.reshape(t, nq * d) @ w.wo
    outs = []
    for start in range(0, t, seq_len):
        n = min(seq_len, t - start)
        qs = q[start : start + n].view(1, n, nq, d).transpose(1, 2)
        ks = k[start : start + n].view(1, n, nkv, d).transpose(1, 2)
        vs = v[start : start + n].view(1, n, nkv, d).transpose(1, 2)
        outs.append(sdpa(qs, ks, vs, causal=True).transpose(1, 2).reshape(n, nq * d))
    o = torch.cat(outs) if len(outs) > 1 else outs[0]
    return o @ w.wo


def swiglu(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """``W2 (silu(W1 x) * W3 x)`` with ``w13 = [W1 | W3]`` as ``[hidden, 2 ffn]``."""
    h = x @ w13
    f = h.shape[-1] // 2
    return (nnf.silu(h[:, :f]) * h[:, f:]) @ w2


def route(a: Tensor, w_router: Tensor, top_k: int, sample_logits: Tensor | None) -> Any:
    """Top-k experts per token and their weights (softmax over the chosen logits).

    ``sample_logits`` (``[num_experts]``, e.g. log of an expert-load profile) replaces
    the learned choice by a Gumbel-top-k draw (benchmarks that must follow a given load);
    the router GEMM still runs and its probabilities still weight the outputs.
    """
    logits = a.float() @ w_router
    if sample_logits is None:
        top, idx = torch.topk(logits, top_k, dim=-1)
    else:
        u = torch.rand(logits.shape, device=logits.device).clamp_(1e-9, 1.0 - 1e-9)
        gumbel = sample_logits[None, :] - torch.log(-torch.log(u))
        idx = torch.topk(gumbel, top_k, dim=-1).indices
        top = torch.gather(logits, 1, idx)
    return idx, torch.softmax(top, dim=-1)


# ------------------------------------------------------------------------------ experts


def grouped_swiglu(x: Tensor, counts: Sequence[int], w13: Tensor, w2: Tensor) -> Tensor:
    """Expert FFNs over rows grouped by slot (``counts[s]`` rows for slot s, in order).

    CUDA with bfloat16: two ``torch._grouped_mm`` calls (one kernel each for all slots);
    otherwise a loop over slots.
    """
    if x.shape[0] == 0:
        return x.new_zeros((0, w2.shape[1]))
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offs = torch.tensor(counts, device=x.device, dtype=torch.int64).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        f = h.shape[-1] // 2
        g = nnf.silu(h[:, :f]) * h[:, f:]
        return torch._grouped_mm(g, w2.transpose(-2, -1), offs=offs)
    out = x.new_empty((x.shape[0], w2.shape[1]))
    start = 0
    for s, n in enumerate(counts):
        if n:
            out[start : start + n] = swiglu(x[start : start + n], w13[s].t(), w2[s].t())
        start += n
    return out


# ------------------------------------------------------------------------------- timing


@dataclass
class PhaseTimer:
    """Marks phase boundaries; CUDA events on a GPU, a host clock on the CPU.

    Phases are the intervals between consecutive :meth:`mark` calls of one step.
    """

    cuda: bool
    marks: list[tuple[str, Any]] = field(default_factory=list)

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def phases_us(self) -> dict[str, float]:
        """Duration of each phase (name of its closing mark), microseconds; waits for the
        device when timing with events."""
        out: dict[str, float] = {}
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        for (_, a), (name, b) in zip(self.marks, self.marks[1:], strict=False):
            dt = a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
            out[name] = out.get(name, 0.0) + dt
        return out


# ------------------------------------------------------------------------------- layer


@dataclass
class MoeLayer:
    """One rank's part of the layer.

    Attributes:
        shape: layer dimensions.
        placement: what every rank does.
        rank, world: this rank and the number of ranks.
        weights: this rank's weights (experts in its slot order).
        tables: routing tables.
        decode: decode (one token per sequence, KV cache) or prefill.
        seq_len: prefill sequence length, tokens.
        fp8_dispatch: send pairs in FP8 (one scale per 128 values).
        group: process group (None: the default group; unused when ``world == 1``).
        sync_phases: add a barrier (a one-element all-reduce) before dispatch and before
            combine, so phase times exclude waiting for other ranks (reported as
            ``wait_dispatch`` and ``wait_combine``).
        sample_logits: see :func:`route`.
    """

    shape: LayerShape
    placement: RankPlacement
    rank: int
    world: int
    weights: LayerWeights
    tables: RoutingTables
    decode: bool
    seq_len: int
    fp8_dispatch: bool = False
    group: Any = None
    sync_phases: bool = False
    sample_logits: Tensor | None = None

    def _a2a(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        if self.world == 1:
            out.copy_(inp)
            return
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _barrier(self, device: Any) -> None:
        if self.world > 1:
            dist.all_reduce(torch.zeros(1, device=device), group=self.group)

    def forward(
        self,
        x: Tensor,
        kv_cache: tuple[Tensor, Tensor] | None = None,
        timer: PhaseTimer | None = None,
    ) -> Tensor:
        """The layer's output for this rank's tokens ``x`` ``[T_r, hidden]``."""
        sh, w = self.shape, self.weights
        dev = x.device
        mark = timer.mark if timer is not None else (lambda name: None)
        mark("start")
        a = x + attention(x, w, sh, decode=self.decode, seq_len=self.seq_len, kv_cache=kv_cache)
        shared = swiglu(a, w.shared_w13, w.shared_w2) if w.shared_w13 is not None else None
        idx, gate = route(a, w.w_router, sh.top_k, self.sample_logits)
        dest_rank, dest_slot = assign_replicas(idx, self.tables)
        mark("attention")
        if self.sync_phases:
            self._barrier(dev)
            mark("wait_dispatch")
        # Dispatch: pairs sorted by (rank, slot); counts per (rank, slot) go first.
        width = self.tables.max_slots
        key = dest_rank * width + dest_slot
        order = torch.argsort(key, stable=True)
        token = torch.div(order, sh.top_k, rounding_mode="floor")
        send_counts = torch.bincount(key, minlength=self.world * width)
        recv_counts = torch.empty_like(send_counts)
        self._a2a(recv_counts, send_counts, [width] * self.world, [width] * self.world)
        sizes = torch.cat(
            [send_counts.view(self.world, width).sum(1), recv_counts.view(self.world, width).sum(1)]
        ).tolist()
        send_splits, recv_splits = sizes[: self.world], sizes[self.world :]
        rows = a[token]
        payload = fp8_pack(rows) if self.fp8_dispatch else rows
        recv = payload.new_empty((sum(recv_splits), payload.shape[1]))
        self._a2a(recv, payload, recv_splits, send_splits)
        mark("dispatch")
        # Experts: group received rows by local slot, run the FFNs, restore the order.
        local = self.tables.slots_per_rank[self.rank]
        per_src = recv_counts.view(self.world, width)[:, :local]
        slot_of_row = torch.repeat_interleave(
            torch.arange(local, device=dev).repeat(self.world), per_src.reshape(-1)
        )
        by_slot = torch.argsort(slot_of_row, stable=True)
        inp = fp8_unpack(recv, sh.hidden, x.dtype) if self.fp8_dispatch else recv
        counts = per_src.sum(0).tolist()
        y_sorted = grouped_swiglu(inp[by_slot], counts, w.w13, w.w2)
        y = torch.empty_like(y_sorted)
        y[by_slot] = y_sorted
        mark("experts")
        if self.sync_phases:
            self._barrier(dev)
            mark("wait_combine")
        back = y.new_empty((sum(send_splits), sh.hidden))
        self._a2a(back, y, send_splits, recv_splits)
        mark("combine")
        # Back to token-major pair order (pair p = token * top_k + j), then each token's
        # gate-weighted sum of its top_k results: one batched GEMM, no atomics.
        by_token = torch.empty_like(back)
        by_token[order] = back
        routed = torch.bmm(
            gate.to(back.dtype).unsqueeze(1), by_token.view(-1, sh.top_k, sh.hidden)
        ).squeeze(1)
        out = a + routed
        if shared is not None:
            out = out + shared
        mark("output")
        return out


def reference_forward(
    x: Tensor,
    shape: LayerShape,
    weights: LayerWeights,
    *,
    decode: bool,
    seq_len: int,
    kv_cache: tuple[Tensor, Tensor] | None,
    fp8_dispatch: bool,
    token_offsets: Sequence[int] = (0,),
) -> Tensor:
    """Single-device reference: every expert local (``weights`` holds experts 0..E-1 in
    order), no communication.

    ``token_offsets`` are the first token of each rank's part of ``x``: prefill sequences
    restart there, as they do on the ranks.
    """
    bounds = [*token_offsets, x.shape[0]]
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        cache = None
        if kv_cache is not None:
            cache = (kv_cache[0][lo:hi], kv_cache[1][lo:hi])
        parts.append(
            attention(x[lo:hi], weights, shape, decode=decode, seq_len=seq_len, kv_cache=cache)
        )
    a = x + torch.cat(parts)
    idx, gate = route(a, weights.w_router, shape.top_k, None)
    inp = fp8_roundtrip(a) if fp8_dispatch else a
    routed = torch.zeros_like(a)
    for e in range(shape.num_experts):
        tok, k = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel():
            y = swiglu(inp[tok], weights.w13[e].t(), weights.w2[e].t())
            routed.index_add_(0, tok, y * gate[tok, k][:, None].to(y.dtype))
    out = a + routed
    if weights.shared_w13 is not None:
        out = out + swiglu(a, weights.shared_w13, weights.shared_w2)
    return out
