"""Triton kernels of the expert phase: a grouped GEMM over rows grouped by slot, with the
gather of each row fused into the first GEMM's loads and ``silu(gate) * up * router
weight`` fused into its epilogue; BF16 or FP8 weights (FP8: one float32 scale per output
channel, the weight tile converted to FP16 in registers - one instruction per pair of
values on Hopper - and the row tile with it, so no activation is quantised and the result
matches dequantised weights to FP16/BF16 rounding).

Layout, ``n`` rows in slot order (``sorted_slot`` ascending, padding rows last with
``slot == S``): the rows are cut into blocks of ``BLOCK_M`` rows of one slot each
(:func:`block_table`, on the device, no host synchronisation; at most ``n // BLOCK_M + S``
blocks, programs past the real ones return at once), and each program computes one block
against one tile of output channels, streaming that slot's weight tile once. Empty slots
have no blocks: their weights are not read.

* :func:`moe_up`: ``g[i] = scale[i] * silu(x[src[i]] Wg[s_i]^T) * (x[src[i]] Wu[s_i]^T)``;
* :func:`moe_down`: ``y[i] = g[i] W2[s_i]^T``;
* :func:`act_rows`: the BF16 grouped path's activation in one pass; :func:`combine_rows`:
  the gather back to pair order, the sum over each token's pairs and the residual add in one
  pass; :func:`quantize_rows`: FP8 rows (with the activation fused) for the FP8 path.

Checked against :func:`agents.runtime.experts.expert_forward`'s ``loop`` kernel (tests
marked ``gpu``). Needs triton and a CUDA GPU (or ``TRITON_INTERPRET=1`` on the CPU).

Units: elements, rows.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

Tensor = Any  # torch.Tensor; torch is untyped for mypy here


def available() -> bool:
    """Whether these kernels can run here (triton imported, a CUDA GPU present)."""
    return bool(torch.cuda.is_available())


@triton.jit  # type: ignore[untyped-decorator]
def moe_gemm_up(  # type: ignore[no-untyped-def]
    x_ptr,
    src_ptr,
    w_ptr,
    ws_ptr,
    rs_ptr,
    out_ptr,
    bslot_ptr,
    brow_ptr,
    bcount_ptr,
    S,
    H: tl.constexpr,
    F: tl.constexpr,
    FP8: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(bslot_ptr + pid_m)
    if slot >= S:
        return
    row0 = tl.load(brow_ptr + pid_m)
    nrows = tl.load(bcount_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < nrows
    src = tl.load(src_ptr + row0 + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    wbase = w_ptr + slot.to(tl.int64) * (2 * F * H)
    a_ptrs = x_ptr + src[:, None] * H + offs_k[None, :]
    g_ptrs = wbase + offs_n[None, :].to(tl.int64) * H + offs_k[:, None]
    u_ptrs = g_ptrs + F * H
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(H // BLOCK_K):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        wg = tl.load(g_ptrs)
        wu = tl.load(u_ptrs)
        if FP8:  # e4m3 -> fp16 is one conversion instruction; the row tile follows
            a = a.to(tl.float16)
            wg = wg.to(tl.float16)
            wu = wu.to(tl.float16)
        acc_g = tl.dot(a, wg, acc_g)
        acc_u = tl.dot(a, wu, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if FP8:
        sbase = ws_ptr + slot.to(tl.int64) * (2 * F)
        acc_g = acc_g * tl.load(sbase + offs_n)[None, :]
        acc_u = acc_u * tl.load(sbase + F + offs_n)[None, :]
    g = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    if HAS_SCALE:
        g = g * tl.load(rs_ptr + row0 + offs_m, mask=mask_m, other=0.0)[:, None]
    rows = (row0 + offs_m).to(tl.int64)
    tl.store(
        out_ptr + rows[:, None] * F + offs_n[None, :],
        g.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None],
    )


@triton.jit  # type: ignore[untyped-decorator]
def moe_gemm_down(  # type: ignore[no-untyped-def]
    g_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    bslot_ptr,
    brow_ptr,
    bcount_ptr,
    S,
    H: tl.constexpr,
    F: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(bslot_ptr + pid_m)
    if slot >= S:
        return
    row0 = tl.load(brow_ptr + pid_m)
    nrows = tl.load(bcount_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < nrows
    rows = (row0 + offs_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = g_ptr + rows[:, None] * F + offs_k[None, :]
    w_ptrs = (
        w_ptr + slot.to(tl.int64) * (H * F) + offs_n[None, :].to(tl.int64) * F + offs_k[:, None]
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(F // BLOCK_K):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs)
        if FP8:
            a = a.to(tl.float16)
            w = w.to(tl.float16)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FP8:
        acc = acc * tl.load(ws_ptr + slot.to(tl.int64) * H + offs_n)[None, :]
    tl.store(
        out_ptr + rows[:, None] * H + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None],
    )


def block_table(counts: Tensor, block_m: int, max_blocks: int) -> tuple[Tensor, Tensor, Tensor]:
    """Blocks of at most ``block_m`` rows of one slot over rows in slot order, on the
    device: per block its slot (``S`` past the real blocks), its first row and its number
    of rows. ``counts``: rows per slot ``[S]`` (int64)."""
    s = counts.shape[0]
    dev = counts.device
    nblk = (counts + block_m - 1) // block_m
    bcum = torch.cumsum(nblk, 0)
    b = torch.arange(max_blocks, device=dev, dtype=torch.int64)
    bslot = torch.searchsorted(bcum, b, right=True)
    safe = bslot.clamp(max=s - 1)
    first_block = bcum[safe] - nblk[safe]
    starts = torch.cumsum(counts, 0) - counts
    within = (b - first_block) * block_m
    brow = starts[safe] + within
    bcount = (counts[safe] - within).clamp(min=0, max=block_m)
    return bslot.to(torch.int32), brow.to(torch.int32), bcount.to(torch.int32)


def tiles(rows_per_slot: float) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for a mean of ``rows_per_slot``:
    weight streaming with 16-row blocks at decode sizes, larger blocks at prefill sizes."""
    if rows_per_slot <= 24:
        return 16, 64, 256, 4, 4
    if rows_per_slot <= 96:
        return 64, 128, 64, 4, 4
    return 128, 128, 64, 8, 3


def _check(h: int, f: int, bn: int, bk: int) -> None:
    if f % bn or h % bn or h % bk or f % bk:
        raise ValueError(f"hidden {h} and ffn {f} must be multiples of {max(bn, bk)}")


def moe_ffn(
    x: Tensor,
    src_row: Tensor,
    counts: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None,
    s2: Tensor | None,
    scale: Tensor | None,
    rows_per_slot: float,
) -> Tensor:
    """``[n, H]``: the expert FFN of every row in slot order (module docstring):
    ``src_row[i]`` is the row of ``x`` sorted row ``i`` reads, ``counts`` the rows per slot
    ``[S]`` (int64), ``scale`` the router weight of each sorted row (None: 1),
    ``rows_per_slot`` the mean the tiles are chosen for. Rows past ``counts.sum()`` are
    padding: their output is undefined.

    Raises:
        ValueError: hidden or FFN width not a multiple of the tiles.
    """
    n, s = src_row.shape[0], w13.shape[0]
    f, h = w13.shape[1] // 2, w13.shape[2]
    bm, bn, bk, warps, stages = tiles(rows_per_slot)
    _check(h, f, bn, bk)
    max_blocks = n // bm + s
    bslot, brow, bcount = block_table(counts, bm, max_blocks)
    fp8 = w13.dtype == torch.float8_e4m3fn
    g = torch.empty((n, f), device=x.device, dtype=x.dtype)
    moe_gemm_up[(max_blocks, f // bn)](
        x,
        src_row,
        w13,
        s13 if fp8 else w13,
        scale if scale is not None else x,
        g,
        bslot,
        brow,
        bcount,
        s,
        H=h,
        F=f,
        FP8=fp8,
        HAS_SCALE=scale is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    y = torch.empty((n, h), device=x.device, dtype=x.dtype)
    moe_gemm_down[(max_blocks, h // bn)](
        g,
        w2,
        s2 if fp8 else w2,
        y,
        bslot,
        brow,
        bcount,
        s,
        H=h,
        F=f,
        FP8=fp8,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return y


@triton.jit  # type: ignore[untyped-decorator]
def fp8_rows(  # type: ignore[no-untyped-def]
    x_ptr,
    rs_ptr,
    q_ptr,
    s_ptr,
    W: tl.constexpr,
    IN_W: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row per program: ``v = x`` (``ACT``: ``silu(x[:W]) * x[W:] * rs``), then
    ``q = v / s`` in FP8 with ``s = max|v| / (448 * 0.98)``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < W
    if ACT:
        g = tl.load(x_ptr + row * IN_W + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * IN_W + W + offs, mask=mask, other=0.0).to(tl.float32)
        v = g / (1.0 + tl.exp(-g)) * u
        if HAS_SCALE:
            v = v * tl.load(rs_ptr + row)
        v = v.to(x_ptr.dtype.element_ty).to(tl.float32)  # the BF16 value the GEMM would see
    else:
        v = tl.load(x_ptr + row * IN_W + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=0)
    s = tl.maximum(amax, 1e-12) / (448.0 * 0.98)
    tl.store(q_ptr + row * W + offs, (v / s).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


def quantize_rows(
    x: Tensor, act: bool = False, scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-row FP8 of ``x`` ``[n, W]`` (``act``: of ``silu(x[:, :W]) * x[:, W:] * scale``
    for ``x`` ``[n, 2W]``) in one pass: (values ``float8_e4m3fn``, float32 scales ``[n]``)."""
    n, in_w = x.shape
    w = in_w // 2 if act else in_w
    q = torch.empty((n, w), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(n, device=x.device, dtype=torch.float32)
    if n:
        fp8_rows[(n,)](
            x,
            scale if scale is not None else s,
            q,
            s,
            W=w,
            IN_W=in_w,
            ACT=act,
            HAS_SCALE=scale is not None,
            BLOCK=triton.next_power_of_2(w),
            num_warps=8,
        )
    return q, s


@triton.jit  # type: ignore[untyped-decorator]
def act_rows_kernel(  # type: ignore[no-untyped-def]
    h_ptr,
    rs_ptr,
    g_ptr,
    W: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, tile): ``g = silu(h[:W]) * h[W:] * rs`` over ``BLOCK`` columns, in
    float32, rounded once to ``g``'s dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < W
    g = tl.load(h_ptr + row * 2 * W + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * W + W + offs, mask=mask, other=0.0).to(tl.float32)
    v = g / (1.0 + tl.exp(-g)) * u
    if HAS_SCALE:
        v = v * tl.load(rs_ptr + row)
    tl.store(g_ptr + row * W + offs, v.to(g_ptr.dtype.element_ty), mask=mask)


def act_rows(h: Tensor, scale: Tensor | None = None) -> Tensor:
    """``silu(h[:, :W]) * h[:, W:]`` (times each row's ``scale``) of ``h`` ``[n, 2W]`` in one
    pass over ``h`` (the up-projection's output), in ``h``'s dtype: the activation of the
    BF16 expert path, where PyTorch takes three to four passes."""
    h = h.contiguous()
    n, in_w = h.shape
    w = in_w // 2
    g = torch.empty((n, w), device=h.device, dtype=h.dtype)
    if n:
        block = 1024
        act_rows_kernel[(n, triton.cdiv(w, block))](
            h,
            scale.float().contiguous() if scale is not None else g,
            g,
            W=w,
            HAS_SCALE=scale is not None,
            BLOCK=block,
            num_warps=4,
        )
    return g


@triton.jit  # type: ignore[untyped-decorator]
def combine_rows_kernel(  # type: ignore[no-untyped-def]
    y_ptr,
    idx_ptr,
    a_ptr,
    sh_ptr,
    out_ptr,
    H: tl.constexpr,
    K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (token, tile): ``out[t] = a[t] (+ shared[t]) + sum_j y[idx[t * K + j]]``
    over ``BLOCK`` columns, accumulated in float32."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.load(a_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(sh_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        r = tl.load(idx_ptr + t * K + j).to(tl.int64)
        acc += tl.load(y_ptr + r * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_rows(
    y: Tensor, index: Tensor, top_k: int, residual: Tensor, shared: Tensor | None = None
) -> Tensor:
    """``residual + shared + sum over k of y[index].view(tokens, top_k, H)`` in one pass:
    the gather of the expert results back into pair order, the sum over each token's
    ``top_k`` pairs and the residual add fused (``y`` ``[rows, H]`` in slot order,
    ``index`` ``[tokens * top_k]`` the row of each pair)."""
    y, residual = y.contiguous(), residual.contiguous()
    tokens, h = residual.shape
    out = torch.empty_like(residual)
    if tokens:
        block = 1024
        combine_rows_kernel[(tokens, triton.cdiv(h, block))](
            y,
            index.contiguous(),
            residual,
            shared.contiguous() if shared is not None else residual,
            out,
            H=h,
            K=top_k,
            HAS_SHARED=shared is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out
