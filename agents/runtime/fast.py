"""The fast reference runtime: one MoE layer as close to the hardware as PyTorch gets.

What differs from :class:`agents.runtime.layer.MoeLayer` (the plan executor kept for the
CPU equivalence tests):

* no host synchronisation anywhere in a step (counts, offsets and replica choices stay on
  the device), so a whole step - or each phase - is captured in a CUDA graph
  (``torch.cuda.CUDAGraph``) and replayed, as SGLang runs decode;
* decode attention packs the query heads of each KV head into one query block (one query
  token attends to the whole cache, so ``[B, kv_heads, q_per_kv, d]`` against ``[B,
  kv_heads, ctx, d]`` is exact) and runs the fastest SDPA backend that accepts the shape
  (cuDNN, then flash), reading the KV cache once;
* expert FFNs are grouped GEMMs: ``torch._grouped_mm`` (BF16) or ``torch._scaled_grouped_mm``
  (FP8 weights with one scale per output channel, activations quantised per row), or, for
  a few rows per expert, one batched GEMM over a padded capacity per slot plus a grouped
  GEMM for the rows beyond it (``capacity``);
* the replica an expert's pair goes to follows the engine's own rule
  (:mod:`policies.estimate.engines`): SGLang ``static`` (``sglang_static_map``: every rank sends an
  expert's tokens to one replica, its nearest), ``even`` (vLLM's hash of the token index
  over the replicas; TensorRT-LLM and SGLang without all-to-all split evenly too) or
  ``planned`` (the plan's shares, native form), chosen by :mod:`agents.runtime.replicas`;

Phases of a step on rank r, ``T`` tokens, ``P = T * top_k`` pairs::

    attention  a = x + Attn(x); s = SharedFFN(a); (idx, w) = topk(softmax(a W_router));
               destination (rank, slot) of every pair under the replica rule
    dispatch   pairs grouped by destination; world > 1: one all_to_all_single with a fixed
               capacity of P rows per destination (equal splits, so no host sync)
    experts    the local slots' FFNs over the received rows, grouped by slot
    combine    results back (world > 1: all_to_all_single), out = a + s + sum_k w_k y_k

Tensors are torch; torch is imported by this module (install ``mixfleet[gpu]``). Multi-GPU
(``world > 1``) runs the same phases over NCCL; it is exercised on CPU processes (gloo) by
the tests and has not run on GPUs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as nnf

from agents.runtime.experts import (
    ExpertPlan,
    ExpertWeights,
    expert_forward,
    expert_plan,
    expert_rows,
    fused_kernels,
    quantize_experts,
)
from agents.runtime.gputiming import event_time_us, graph_time_us, profiled_segments
from agents.runtime.layer import LayerShape, LayerWeights, make_weights
from agents.runtime.replicas import (
    REPLICA_RULES,
    DeviceMap,
    ReplicaMap,
    choose_physical,
    device_map,
    engine_runtime,
    replica_map,
    route_logits,
)
from agents.runtime.routing import RankPlacement

__all__ = [
    "PHASES",
    "REPLICA_RULES",
    "FastLayer",
    "ReplicaMap",
    "build_fast_layer",
    "choose_physical",
    "engine_runtime",
    "phase_summary",
    "replica_map",
    "route_logits",
]

Tensor = Any  # torch.Tensor; torch is untyped for mypy here

PHASES = ("attention", "dispatch", "experts", "combine")


# ---------------------------------------------------------------------------- attention

_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def _sdpa(q: Tensor, k: Tensor, v: Tensor, backend: str, causal: bool) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if backend == "math" and gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        gqa = False
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, _BACKENDS[backend])]):
        return nnf.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


# -------------------------------------------------------------------------------- layer


@dataclass
class FastLayer:
    """One rank's part of the layer with static shapes (every step the same sizes).

    Build with :func:`build_fast_layer`. :meth:`step` runs one step eagerly;
    :meth:`capture` records CUDA graphs (one per phase and one for the whole step) and
    :meth:`time_graphs` replays them.

    Attributes:
        shape, tokens, decode, seq_len, context: the step (``tokens`` on this rank;
            decode: one sequence per token with ``context`` cached tokens; prefill: causal
            sequences of ``seq_len``).
        rank, world, group: the expert-parallel group (``world == 1``: no communication).
        weights: attention, router and shared-expert weights (``w13``/``w2`` unused).
        experts: the local slots' weights.
        rmap: replica choice; plan: expert grouping.
        attn_backend: SDPA backend (``cudnn`` | ``flash`` | ``efficient`` | ``math``).
        sample_logits: ``[E]`` log load profile the router draws from (None: learned).
        x, kv: the static input ``[tokens, hidden]`` and decode KV cache.
        group: process group (None: the default group).
        capacity: rows per destination rank in dispatch (the most pairs any rank has).
        wqkv: ``[hidden, (q_heads + 2 kv_heads) * head_dim]`` fused projection.
        w_router: router weights in the compute dtype (logits are taken in float32).
    """

    shape: LayerShape
    tokens: int
    decode: bool
    seq_len: int
    context: int
    rank: int
    world: int
    weights: LayerWeights
    experts: ExpertWeights
    rmap: DeviceMap
    rule: str
    plan: ExpertPlan
    attn_backend: str
    sample_logits: Tensor | None
    x: Tensor
    kv: tuple[Tensor, Tensor] | None
    group: Any = None
    capacity: int = 0
    wqkv: Tensor = None
    w_router: Tensor = None
    kernel_us: dict[str, float] = field(default_factory=dict)
    st: dict[str, Tensor] = field(default_factory=dict)
    graphs: dict[str, Any] = field(default_factory=dict)
    _keep: list[Any] = field(default_factory=list)

    # Each phase reads and writes ``self.st``; captured separately they chain through it.
    def phase_attention(self) -> None:
        sh, w, x = self.shape, self.weights, self.x
        t, nq, nkv, d = self.tokens, sh.num_q_heads, sh.num_kv_heads, sh.head_dim
        qkv = x @ self.wqkv
        q, k, v = qkv[:, : nq * d], qkv[:, nq * d : (nq + nkv) * d], qkv[:, (nq + nkv) * d :]
        if self.decode:
            assert self.kv is not None
            kc, vc = self.kv
            kc[:, :, -1] = k.view(t, nkv, d)
            vc[:, :, -1] = v.view(t, nkv, d)
            o = _sdpa(q.reshape(t, nkv, nq // nkv, d), kc, vc, self.attn_backend, causal=False)
        else:
            b, s = t // self.seq_len, self.seq_len
            o = _sdpa(
                q.reshape(b, s, nq, d).transpose(1, 2),
                k.reshape(b, s, nkv, d).transpose(1, 2),
                v.reshape(b, s, nkv, d).transpose(1, 2),
                self.attn_backend,
                causal=True,
            ).transpose(1, 2)
        a = x + o.reshape(t, nq * d) @ w.wo
        if w.shared_w13 is not None:
            hs = a @ w.shared_w13
            f = hs.shape[-1] // 2
            self.st["shared"] = (nnf.silu(hs[:, :f]) * hs[:, f:]) @ w.shared_w2
        idx, gate = route_logits((a @ self.w_router).float(), sh.top_k, self.sample_logits)
        self.st["a"], self.st["gate"] = a, gate
        self.st["phys"] = choose_physical(idx, self.rmap, self.rule)

    def phase_dispatch(self) -> None:
        a, phys = self.st["a"], self.st["phys"]
        k = self.shape.top_k
        pairs = phys.shape[0]
        spr = self.experts.slots
        token = torch.arange(pairs, device=a.device) // k
        if self.world == 1:  # the experts gather their rows straight from ``a``
            self.st["rows"], self.st["row_of"], self.st["slot"] = a, token, phys
            self.st["scale"] = self.st["gate"].reshape(-1)
            return
        # Fixed capacity of ``pairs`` rows per destination: equal splits, no host sync.
        dest = phys // spr
        order = torch.argsort(dest, stable=True)
        counts = torch.zeros(self.world, dtype=torch.int64, device=a.device)
        counts.scatter_add_(0, dest, torch.ones_like(dest))
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(pairs, device=a.device) - starts[dest[order]]
        where = torch.empty_like(pos)
        cap = self.capacity
        where[order] = dest[order] * cap + pos  # send-buffer row of each pair
        send = a.new_zeros((self.world * cap, a.shape[1]))
        send[where] = a[token]
        send_slot = torch.full((self.world * cap,), spr, dtype=torch.int64, device=a.device)
        send_slot[where] = phys % spr
        recv = torch.empty_like(send)
        recv_slot = torch.empty_like(send_slot)
        dist.all_to_all_single(recv, send, group=self.group)
        dist.all_to_all_single(recv_slot, send_slot, group=self.group)
        self.st["rows"], self.st["slot"], self.st["where"] = recv, recv_slot, where
        self.st.pop("row_of", None)
        self.st.pop("scale", None)

    def phase_experts(self) -> None:
        st = self.st
        args = (st["rows"], st.get("row_of"), st["slot"], self.experts, self.plan, st.get("scale"))
        if self.world == 1:  # the gather back to pair order is left to the combine
            st["y"], st["y_index"] = expert_rows(*args)
        else:
            st["y"] = expert_forward(*args)

    def phase_combine(self) -> None:
        y, a, gate = self.st["y"], self.st["a"], self.st["gate"]
        k = self.shape.top_k
        if self.world > 1:
            back = torch.empty_like(y)
            dist.all_to_all_single(back, y, group=self.group)
            y = back[self.st["where"]]
            routed = torch.bmm(gate.to(y.dtype).unsqueeze(1), y.view(self.tokens, k, -1))
            routed = routed.squeeze(1)
        else:  # rows already carry their router weight (phase_dispatch)
            index = self.st["y_index"]
            if y.is_cuda and index is not None and fused_kernels():  # gather + sum + add
                from agents.runtime.triton_experts import combine_rows

                self.st["out"] = combine_rows(y, index, k, a, self.st.get("shared"))
                return
            routed = (y if index is None else y[index]).view(self.tokens, k, -1).sum(1)
        out = a + routed
        if "shared" in self.st:
            out = out + self.st["shared"]
        self.st["out"] = out

    def resized(
        self, tokens: int, *, decode: bool, seq_len: int, context: int, seed: int = 1
    ) -> FastLayer:
        """A layer sharing these weights for a step of another size (world size 1): fresh
        input and decode KV cache drawn on the device, the expert plan for the new number
        of pairs, no graphs (capture again). For sweeps over batch sizes and contexts
        without rebuilding the weights.

        Raises:
            ValueError: more than one rank; prefill tokens not whole sequences.
        """
        if self.world != 1:
            raise ValueError("resized() is for world size 1")
        if not decode and tokens % seq_len:
            raise ValueError(f"prefill tokens {tokens} are not whole sequences of {seq_len}")
        sh, dev, dt = self.shape, self.x.device, self.x.dtype
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn((tokens, sh.hidden), generator=g, device=dev, dtype=dt)
        kv = None
        if decode:
            dims = (tokens, sh.num_kv_heads, context, sh.head_dim)
            kv = (
                torch.randn(dims, generator=g, device=dev, dtype=dt),
                torch.randn(dims, generator=g, device=dev, dtype=dt),
            )
        rows = tokens * sh.top_k
        plan = expert_plan("auto", rows, self.experts.slots, self.experts.dtype, dev.type == "cuda")
        layer = replace(
            self,
            tokens=tokens,
            decode=decode,
            seq_len=seq_len,
            context=context,
            plan=plan,
            x=x,
            kv=kv,
            capacity=rows,
            st={},
            graphs={},
            _keep=[],
        )
        layer.attn_backend = _first_backend(layer, _attn_backends(decode, dev.type == "cuda"))
        layer.tune_experts()
        return layer

    def tune_experts(self, candidates: tuple[str, ...] = ("triton", "grouped", "capacity")) -> None:
        """Keep the fastest expert kernel of ``candidates`` for this layer's rows (CUDA
        only; a kernel that cannot run here, or ``capacity`` with FP8 weights, is skipped):
        each replayed from a CUDA graph on the layer's own number of pairs with uniformly
        drawn slots, as an engine picks its MoE kernel configuration per batch size. ``kernel_us`` records
        the times, microseconds."""
        if self.x.device.type != "cuda":
            return
        rows = self.plan.rows
        dev = self.x.device
        g = torch.Generator(device=dev).manual_seed(rows)
        slot = torch.randint(0, self.experts.slots, (rows,), device=dev, generator=g)
        row_of = torch.arange(rows, device=dev) % self.x.shape[0]
        scale = torch.rand(rows, device=dev, generator=g)
        times: dict[str, float] = {}
        for k in candidates:
            if k == "capacity" and self.experts.dtype == "fp8":
                continue
            plan = expert_plan(k, rows, self.experts.slots, self.experts.dtype, True)
            try:
                run = partial(expert_forward, self.x, row_of, slot, self.experts, plan, scale)
                times[k] = graph_time_us(run, reps=5)
            except Exception:
                continue
        if times:
            best = min(times, key=lambda k: times[k])
            self.plan = expert_plan(best, rows, self.experts.slots, self.experts.dtype, True)
        self.kernel_us = times

    def time_layer_phases(self, iters: int) -> dict[str, float] | None:
        """Each phase's time inside the whole-step graph, as an engine that replays one
        graph per step runs it: each phase graph once, then the step graph ``iters``
        times, under one ``torch.profiler`` session; the step's kernels cut into phases
        by each phase graph's kernel count, a phase from its first kernel's start to the next phase's first kernel's
        start (the last to its last kernel's end); the medians, scaled so that they sum to
        the step graph's event-timed median, microseconds (``layer``, and ``profiled``:
        the unscaled step). None when the kernels cannot be cut (the profiler does not
        see the kernels inside graphs, or the counts differ). Call after :meth:`capture`."""
        calls = [self.graphs[n].replay for n in PHASES]
        calls += [self.graphs["layer"].replay] * iters
        segments = profiled_segments(calls)
        if segments is None or len(segments) != len(calls):
            return None
        counts = {n: len(segments[i]) for i, n in enumerate(PHASES)}
        per_rep = sum(counts.values())
        layer_segs = segments[len(PHASES) :]
        if per_rep == 0 or any(len(seg) != per_rep for seg in layer_segs):
            return None
        spans = [x for seg in layer_segs for x in seg]
        per: dict[str, list[float]] = {k: [] for k in (*PHASES, "layer")}
        for r in range(iters):
            rep = spans[r * per_rep : (r + 1) * per_rep]
            cuts: list[tuple[str, float]] = []
            at = 0
            for name in PHASES:
                if counts[name]:
                    cuts.append((name, rep[at][0]))
                at += counts[name]
            end = rep[-1][1]
            ends = [c[1] for c in cuts[1:]] + [end]
            span = {name: e - st for (name, st), e in zip(cuts, ends, strict=True)}
            for name in PHASES:
                per[name].append(span.get(name, 0.0))
            per["layer"].append(end - rep[0][0])
        med = {k: float(statistics.median(v)) for k, v in per.items()}
        step = event_time_us(self.graphs["layer"].replay, reps=iters)
        f = step / med["layer"] if med["layer"] > 0 else 1.0
        out = {k: med[k] * f for k in PHASES}
        out["layer"] = step
        out["profiled"] = med["layer"]
        return out

    def phase_fns(self) -> dict[str, Callable[[], None]]:
        return {
            "attention": self.phase_attention,
            "dispatch": self.phase_dispatch,
            "experts": self.phase_experts,
            "combine": self.phase_combine,
        }

    def step(self) -> Tensor:
        """One step, eagerly; the output ``[tokens, hidden]``."""
        for fn in self.phase_fns().values():
            fn()
        return self.st["out"]

    def capture(self, warmup: int = 3) -> None:
        """Record one CUDA graph per phase and one for the whole step (after ``warmup``
        eager steps on a side stream, as ``torch.cuda.graphs`` asks). When the attention
        backend cannot be captured, flash attention is captured instead (``attn_backend``
        says which ran)."""
        try:
            self._capture(warmup)
        except RuntimeError:
            if self.attn_backend == "flash":
                raise
            torch.cuda.synchronize()
            self.graphs.clear()
            self._keep.clear()
            self.attn_backend = "flash"
            self._capture(warmup)

    def _capture(self, warmup: int) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for name, fn in self.phase_fns().items():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            self.graphs[name] = g
            self._keep.append(dict(self.st))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.step()
        self.graphs["layer"] = g
        self._keep.append(dict(self.st))
        torch.cuda.synchronize()

    def time_graphs(self, iters: int, warmup: int = 3) -> dict[str, float]:
        """Median replay time per phase graph and of the whole-step graph, microseconds."""
        for _ in range(warmup):
            for name in (*PHASES, "layer"):
                self.graphs[name].replay()
        per: dict[str, list[float]] = {k: [] for k in (*PHASES, "layer")}
        for _ in range(iters):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
            ev[0].record()
            for i, name in enumerate(PHASES):
                self.graphs[name].replay()
                ev[i + 1].record()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.graphs["layer"].replay()
            b.record()
            b.synchronize()
            for i, name in enumerate(PHASES):
                per[name].append(ev[i].elapsed_time(ev[i + 1]) * 1e3)
            per["layer"].append(a.elapsed_time(b) * 1e3)
        return {k: float(statistics.median(v)) for k, v in per.items()}

    def time_eager(self, iters: int, warmup: int = 2) -> float:
        """Median eager step time (every kernel launched from Python), microseconds."""
        for _ in range(warmup):
            self.step()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return float(statistics.median(times))


def _attn_backends(decode: bool, cuda: bool) -> tuple[str, ...]:
    if not cuda:
        return ("math",)
    return ("cudnn", "flash", "efficient") if decode else ("flash", "cudnn", "efficient")


def build_fast_layer(
    shape: LayerShape,
    placement: RankPlacement,
    *,
    rank: int,
    decode: bool,
    seq_len: int,
    context: int,
    device: Any,
    dtype: Any,
    expert_dtype: str = "bf16",
    rule: str = "static",
    kernel: str = "auto",
    attn_backend: str = "auto",
    sample_logits: Tensor | None = None,
    seeded_experts: bool = True,
    group: Any = None,
    seed: int = 0,
) -> FastLayer:
    """A :class:`FastLayer` for ``rank`` of ``placement`` (weights drawn as
    :func:`agents.runtime.layer.make_weights` draws them, input and KV cache seeded).

    ``attn_backend="auto"`` tries the backends in order of speed on this shape (cuDNN,
    flash, efficient for decode; flash first for prefill) and keeps the first that runs.

    Raises:
        ValueError: bad rule or kernel; prefill tokens not whole sequences; see
            :func:`replica_map`.
    """
    tokens = placement.tokens[rank]
    if not decode and tokens % seq_len:
        raise ValueError(f"prefill tokens {tokens} are not whole sequences of {seq_len}")
    rmap = replica_map(placement, shape.num_experts, rule)
    experts = [e for e, _ in placement.slots[rank]]
    w = make_weights(
        shape, experts, device=device, dtype=dtype, seed=seed, seeded_experts=seeded_experts
    )
    ew = (
        quantize_experts(w.w13, w.w2)
        if expert_dtype == "fp8"
        else ExpertWeights("bf16", w.w13, w.w2)
    )
    cuda = getattr(device, "type", str(device)) == "cuda"
    capacity = max(placement.tokens) * shape.top_k
    rows = capacity * placement.world if placement.world > 1 else tokens * shape.top_k
    x, kv = _inputs(shape, tokens, decode, context, device, dtype, seed + 7919 * (rank + 1))
    layer = FastLayer(
        shape,
        tokens,
        decode,
        seq_len,
        context,
        rank,
        placement.world,
        w,
        ew,
        device_map(rmap, rank, device),
        rule,
        expert_plan(kernel, rows, ew.slots, expert_dtype, cuda),
        "math",
        sample_logits,
        x,
        kv,
        group,
        capacity,
    )
    layer.weights.w13 = layer.weights.w2 = None  # the experts live in ``layer.experts``
    layer.wqkv = torch.cat([w.wq, w.wk, w.wv], dim=1)  # one projection GEMM, as engines run
    layer.w_router = w.w_router.to(dtype)  # router GEMM in the compute dtype, float32 logits
    candidates = _attn_backends(decode, cuda) if attn_backend == "auto" else (attn_backend,)
    layer.attn_backend = _first_backend(layer, candidates)
    if kernel == "auto" and cuda:
        layer.tune_experts()
    return layer


def _first_backend(layer: FastLayer, candidates: tuple[str, ...]) -> str:
    """The attention backend of ``candidates`` for ``layer``: in decode on a GPU the
    fastest on this batch and context of those that run (cuDNN reads a long cache of a
    few sequences with few thread blocks; flash splits it), else the first that runs.

    Raises:
        RuntimeError: none runs (the last one's error).
    """
    runs: list[str] = []
    for i, b in enumerate(candidates):
        layer.attn_backend = b
        try:
            layer.phase_attention()
            runs.append(b)
            if not (layer.decode and layer.x.device.type == "cuda"):
                return b
        except RuntimeError:
            if i == len(candidates) - 1 and not runs:
                raise
    if len(runs) == 1:
        layer.attn_backend = runs[0]
        return runs[0]
    assert layer.kv is not None
    sh, kc, vc = layer.shape, layer.kv[0], layer.kv[1]
    q = torch.randn(
        (layer.tokens, sh.num_kv_heads, sh.num_q_heads // sh.num_kv_heads, sh.head_dim),
        device=kc.device,
        dtype=kc.dtype,
    )
    times = {b: event_time_us(partial(_sdpa, q, kc, vc, b, causal=False), 5) for b in runs}
    best = min(times, key=lambda b: times[b])
    layer.attn_backend = best
    return best


def _inputs(
    shape: LayerShape, tokens: int, decode: bool, context: int, device: Any, dtype: Any, seed: int
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """Seeded input ``[tokens, hidden]`` and (decode) KV cache ``[tokens, kv_heads,
    context, head_dim]``, drawn on the CPU so every device gets the same values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=g).to(device=device, dtype=dtype)
    kv = None
    if decode:
        dims = (tokens, shape.num_kv_heads, context, shape.head_dim)
        kv = (
            torch.randn(dims, generator=g).to(device=device, dtype=dtype),
            torch.randn(dims, generator=g).to(device=device, dtype=dtype),
        )
    return x, kv


def phase_summary(times: dict[str, float]) -> dict[str, float]:
    """Phase times plus the gap between the whole-step graph and the phases' sum."""
    total = math.fsum(times[p] for p in PHASES)
    return {**times, "phases_sum": total, "graph_gap": times["layer"] - total}
