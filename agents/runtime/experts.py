"""The expert phase of the fast runtime (:mod:`agents.runtime.fast`): the local slots'
weights in BF16 or FP8 (:class:`ExpertWeights`, :func:`quantize_experts`), how rows are
grouped for the GEMM kernels (:class:`ExpertPlan`, :func:`expert_plan`) and the FFNs over
rows grouped by slot without any host synchronisation (:func:`expert_forward`).

Kernels: :func:`agents.runtime.triton_experts.moe_ffn` (``triton``: BF16 or FP8 weights,
gather and activation fused into the GEMMs), ``torch._grouped_mm`` (BF16) and ``torch._scaled_grouped_mm`` (FP8 weights with
one scale per output channel, activations quantised per row, groups padded to 16 rows);
``capacity``: one batched GEMM over a padded capacity per slot (``torch.bmm``) plus a
grouped GEMM for the rows beyond it; ``loop``: one GEMM pair per slot with host-side counts
(the CPU path and the reference).

Everything is torch (imported by this module: install ``mixfleet[gpu]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as nnf

Tensor = Any  # torch.Tensor; torch is untyped for mypy here

EXPERT_KERNELS = ("auto", "grouped", "capacity", "triton", "loop")
"""Expert GEMM kernels; ``auto`` takes ``capacity`` for BF16 at <= 32 rows per slot on
average, else ``grouped`` (:meth:`agents.runtime.fast.FastLayer.tune_experts` times the
candidates instead); ``triton`` is :mod:`agents.runtime.triton_experts` (gather and
activation fused, empty slots not read); ``loop`` (one GEMM per slot, host-side counts) is
the CPU path and the reference."""

FP8_MAX = 448.0  # largest float8_e4m3fn value


@dataclass
class ExpertWeights:
    """The local slots' weights in the layout the kernels read.

    Attributes:
        dtype: ``bf16`` (or the compute dtype on CPU) or ``fp8``.
        w13: ``[S, 2F, H]`` gate and up; w2 ``[S, H, F]`` down (fp8: float8_e4m3fn).
        s13, s2: fp8 only: float32 scales per output channel ``[S, 2F]``, ``[S, H]``.
    """

    dtype: str
    w13: Tensor
    w2: Tensor
    s13: Tensor | None = None
    s2: Tensor | None = None

    @property
    def slots(self) -> int:
        return int(self.w13.shape[0])

    @property
    def bytes(self) -> float:
        return float(self.w13.numel() * self.w13.element_size() * 1.5)


def quantize_experts(w13: Tensor, w2: Tensor) -> ExpertWeights:
    """FP8 (e4m3) weights with one float32 scale per output channel (16 slots at a time,
    so the float32 temporaries stay small)."""
    out = []
    for w in (w13, w2):
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        s = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
        for lo in range(0, w.shape[0], 16):
            part = w[lo : lo + 16].float()
            s[lo : lo + 16] = part.abs().amax(-1).clamp_(min=1e-12) / FP8_MAX
            q[lo : lo + 16] = (part / s[lo : lo + 16, :, None]).to(torch.float8_e4m3fn)
        out.append((q, s))
    return ExpertWeights("fp8", out[0][0], out[1][0], out[0][1], out[1][1])


def _rowwise_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row FP8 of ``x``: values and float32 scales (computed in ``x``'s dtype, a few
    passes over the rows; the margin below 448 keeps rounding from overflowing)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1).float()
    s = (amax.clamp_(min=1e-12) / (FP8_MAX * 0.98)).to(x.dtype)
    return (x / s[:, None]).to(torch.float8_e4m3fn), s.float()


def fused_kernels() -> bool:
    """Whether the Triton kernels of the expert phase (one-pass activation, FP8 row
    quantisation, fused combine) can run here: triton imported and a CUDA GPU."""
    try:
        from agents.runtime import triton_experts

        return triton_experts.available()
    except ImportError:
        return False


def _gemm(
    x: Tensor,
    w: Tensor,
    scale: Tensor | None,
    offs: Tensor,
    out_dtype: Any,
    quantized: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Grouped ``x @ w[s].T`` over row groups ending at ``offs`` (FP8 weights: ``x``
    quantised per row, or ``quantized`` given as (values, scales))."""
    if scale is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if quantized is not None:
        x8, sx = quantized
    elif x.is_cuda and fused_kernels():
        from agents.runtime.triton_experts import quantize_rows

        x8, sx = quantize_rows(x)
    else:
        x8, sx = _rowwise_fp8(x)
    return torch._scaled_grouped_mm(
        x8, w.transpose(-2, -1), sx, scale, offs=offs, out_dtype=out_dtype
    )


def _act(h: Tensor, scale: Tensor | None) -> Tensor:
    """``silu(gate) * up``, times each row's ``scale`` (the router weight of the pair: the
    down projection is linear, so scaling its input scales its output)."""
    f = h.shape[-1] // 2
    g = nnf.silu(h[..., :f]) * h[..., f:]
    return g if scale is None else g * scale.to(g.dtype).unsqueeze(-1)


def _ffn_grouped(x: Tensor, w: ExpertWeights, offs: Tensor, scale: Tensor | None) -> Tensor:
    h = _gemm(x, w.w13, w.s13, offs, x.dtype)
    if h.is_cuda and fused_kernels():  # the activation in one pass (and FP8 with it)
        from agents.runtime.triton_experts import act_rows, quantize_rows

        if w.s2 is not None:
            q = quantize_rows(h, act=True, scale=None if scale is None else scale.float())
            return _gemm(h, w.w2, w.s2, offs, x.dtype, quantized=q)
        return _gemm(act_rows(h, scale), w.w2, None, offs, x.dtype)
    return _gemm(_act(h, scale), w.w2, w.s2, offs, x.dtype)


def _ffn_loop(x: Tensor, w: ExpertWeights, counts: Sequence[int], scale: Tensor | None) -> Tensor:
    """One GEMM pair per slot (host-side counts; the CPU path and the reference)."""
    out = x.new_zeros((x.shape[0], w.w2.shape[1]))
    start = 0
    for s, n in enumerate(counts):
        if n:
            w13, w2 = w.w13[s], w.w2[s]
            xs = x[start : start + n]
            if w.dtype == "fp8":
                assert w.s13 is not None and w.s2 is not None
                x8, sx = _rowwise_fp8(xs)
                h = (x8.float() * sx[:, None]) @ (w13.float() * w.s13[s][:, None]).t()
            else:
                h = xs @ w13.t()
            sc = None if scale is None else scale[start : start + n]
            g = _act(h, sc).to(x.dtype)
            if w.dtype == "fp8":
                assert w.s2 is not None
                g8, sg = _rowwise_fp8(g)
                y = (g8.float() * sg[:, None]) @ (w2.float() * w.s2[s][:, None]).t()
            else:
                y = g @ w2.t()
            out[start : start + n] = y.to(x.dtype)
        start += n
    return out


@dataclass
class ExpertPlan:
    """How the expert phase groups rows (fixed at build time, so steps are capturable).

    Attributes:
        kernel: ``grouped`` | ``capacity`` | ``loop``.
        rows: rows the phase receives per step (pairs, or world x capacity).
        capacity: ``capacity`` only: rows per slot of the batched GEMM.
        align: rows per group are padded to a multiple of this (FP8 grouped GEMM).
    """

    kernel: str
    rows: int
    capacity: int = 0
    align: int = 1


def expert_plan(kernel: str, rows: int, slots: int, dtype: str, cuda: bool) -> ExpertPlan:
    """The expert kernel for ``rows`` rows over ``slots`` slots."""
    if kernel not in EXPERT_KERNELS:
        raise ValueError(f"expert kernel {kernel!r}: choose one of {', '.join(EXPERT_KERNELS)}")
    if not cuda:
        return ExpertPlan("loop", rows)
    if kernel == "auto":
        kernel = "capacity" if dtype != "fp8" and rows <= 32 * slots else "grouped"
    if kernel == "capacity" and dtype == "fp8":
        kernel = "grouped"  # no batched FP8 GEMM in torch
    if kernel == "triton":
        return ExpertPlan("triton", rows)
    if kernel == "capacity":
        mean = rows / max(slots, 1)
        return ExpertPlan("capacity", rows, capacity=max(16, -(-int(2 * mean) // 16) * 16))
    return ExpertPlan(kernel, rows, align=16 if dtype == "fp8" else 1)


def expert_forward(
    src: Tensor,
    row_of: Tensor | None,
    slot: Tensor,
    w: ExpertWeights,
    plan: ExpertPlan,
    scale: Tensor | None = None,
) -> Tensor:
    """``y[i] = scale[i] * FFN_{slot[i]}(src[row_of[i]])`` (``row_of`` None: row i; no
    ``scale``: 1); rows with ``slot == w.slots`` are padding (their output is undefined).
    Rows are gathered once into slot order (padded per group when the plan asks) and the
    results gathered back once (:func:`expert_rows` leaves that gather to the caller). No
    host synchronisation except in the ``loop`` kernel."""
    y, index = expert_rows(src, row_of, slot, w, plan, scale)
    return y if index is None else y[index]


def expert_rows(
    src: Tensor,
    row_of: Tensor | None,
    slot: Tensor,
    w: ExpertWeights,
    plan: ExpertPlan,
    scale: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`expert_forward` without the last gather: ``(y, index)`` with the result of
    row ``i`` at ``y[index[i]]`` (``index`` None: at ``y[i]``), so that a combine step can
    fuse that gather with the sum over each token's pairs
    (:func:`agents.runtime.triton_experts.combine_rows`)."""
    s = w.slots
    n = slot.shape[0]
    dev = slot.device
    order = torch.argsort(slot, stable=True)
    sorted_slot = slot[order]
    src_row = order if row_of is None else row_of[order]
    sorted_scale = None if scale is None else scale[order]
    counts = torch.zeros(s + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, slot, torch.ones_like(slot))
    counts = counts[:s]
    if plan.kernel == "loop":
        out = src.new_empty((n, w.w2.shape[1]))
        out[order] = _ffn_loop(src[src_row], w, counts.tolist(), sorted_scale)
        return out, None
    inverse = torch.empty_like(order)
    if plan.kernel == "triton":
        from agents.runtime.triton_experts import moe_ffn

        y = moe_ffn(
            src, src_row, counts, w.w13, w.w2, w.s13, w.s2, sorted_scale, plan.rows / max(s, 1)
        )
        inverse[order] = torch.arange(n, device=dev)
        return y, inverse
    if plan.kernel == "grouped" and plan.align == 1:  # padding rows sort last, past offs
        offs = torch.cumsum(counts, 0).to(torch.int32)
        y = _ffn_grouped(src[src_row], w, offs, sorted_scale)
        inverse[order] = torch.arange(n, device=dev)
        return y, inverse
    starts = torch.cumsum(counts, 0) - counts
    valid = sorted_slot < s
    clamped = sorted_slot.clamp(max=s - 1)
    pos = torch.arange(n, device=dev) - starts[clamped]
    if plan.kernel == "capacity":
        both, at = _capacity_rows(src, src_row, sorted_scale, counts, clamped, pos, valid, w, plan)
        inverse[order] = at
        return both, inverse
    a = plan.align
    padded = (counts + a - 1) // a * a
    pstarts = torch.cumsum(padded, 0) - padded
    total = n + (a - 1) * s
    dest = torch.where(valid, pstarts[clamped] + pos, total)
    gidx = torch.zeros(total + 1, dtype=torch.int64, device=dev)
    gidx[dest] = src_row
    pscale = None
    if sorted_scale is not None:
        pscale = sorted_scale.new_zeros(total + 1)
        pscale[dest] = sorted_scale
        pscale = pscale[:total]
    yb = _ffn_grouped(src[gidx[:total]], w, torch.cumsum(padded, 0).to(torch.int32), pscale)
    inverse[order] = dest.clamp(max=total - 1)
    return yb, inverse


def _capacity_rows(
    src: Tensor,
    src_row: Tensor,
    sorted_scale: Tensor | None,
    counts: Tensor,
    clamped: Tensor,
    pos: Tensor,
    valid: Tensor,
    w: ExpertWeights,
    plan: ExpertPlan,
) -> tuple[Tensor, Tensor]:
    """The ``capacity`` kernel over rows in slot order (``clamped`` slot and position
    ``pos`` of each): (results of the capacity rows then the overflow rows, where each
    sorted row's result is)."""
    s, n, dev = w.slots, pos.shape[0], pos.device
    c = plan.capacity
    in_cap = valid & (pos < c)
    # Buffer rows of the batched GEMM: slot * c + position; rows beyond the capacity and
    # padding go to a sink row. Unused rows read row 0 (their output is never read).
    dest = torch.where(in_cap, clamped * c + pos, s * c)
    gidx = torch.zeros(s * c + 1, dtype=torch.int64, device=dev)
    gidx[dest] = src_row
    bscale = None
    if sorted_scale is not None:
        bscale = sorted_scale.new_zeros(s * c + 1)
        bscale[dest] = sorted_scale
        bscale = bscale[: s * c].view(s, c)
    xb = src[gidx[: s * c]].view(s, c, -1)
    h = torch.bmm(xb, w.w13.transpose(-2, -1))
    yb = torch.bmm(_act(h, bscale), w.w2.transpose(-2, -1)).view(s * c, -1)
    # Rows beyond the capacity: a grouped GEMM over the overflow only (slots without
    # overflow have empty groups and read no weights).
    over = (counts - c).clamp(min=0)
    ostarts = torch.cumsum(over, 0) - over
    ovalid = valid & ~in_cap
    odest = torch.where(ovalid, ostarts[clamped] + pos - c, n)
    ogidx = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    ogidx[odest] = src_row
    oscale = None
    if sorted_scale is not None:
        oscale = sorted_scale.new_zeros(n + 1)
        oscale[odest] = sorted_scale
        oscale = oscale[:n]
    oy = _ffn_grouped(src[ogidx[:n]], w, torch.cumsum(over, 0).to(torch.int32), oscale)
    both = torch.cat([yb, oy])  # capacity rows, then overflow rows
    where = torch.where(ovalid, s * c + odest.clamp(max=n - 1), dest.clamp(max=s * c - 1))
    return both, where
