"""The Triton expert kernels (agents.runtime.triton_experts) against the reference loop
(one GEMM pair per slot in float32, agents.runtime.experts ``loop``): BF16 and FP8 weights,
decode and prefill tile sizes, padding rows, empty slots, gathered rows and router weights
fused; fresh random inputs each time and a poisoned output buffer. GPU only (skipped
elsewhere, with the reason); the layer-level kernel choice and the in-graph phase times
are checked on the same GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch (mixfleet[gpu])")
pytest.importorskip("triton", reason="the Triton kernels need triton")

from test_fast_runtime import gpu_decode_layer  # noqa: E402

from agents.runtime.experts import (  # noqa: E402
    ExpertPlan,
    ExpertWeights,
    expert_forward,
    quantize_experts,
)
from agents.runtime.fast import PHASES  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a CUDA GPU"),
]


def _weights(s: int, h: int, f: int, seed: int, fp8: bool) -> ExpertWeights:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(s, 2 * f, h, device="cuda", generator=g) / h**0.5
    w2 = torch.randn(s, h, f, device="cuda", generator=g) / f**0.5
    if fp8:
        return quantize_experts(w13.bfloat16(), w2.bfloat16())
    return ExpertWeights("bf16", w13.bfloat16(), w2.bfloat16())


def _float32(w: ExpertWeights) -> ExpertWeights:
    if w.dtype == "fp8":
        assert w.s13 is not None and w.s2 is not None
        return ExpertWeights(
            "bf16", w.w13.float() * w.s13[..., None], w.w2.float() * w.s2[..., None]
        )
    return ExpertWeights("bf16", w.w13.float(), w.w2.float())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows_per_slot", [0.25, 4, 40, 300])
def test_triton_kernel_matches_the_loop(fp8: bool, rows_per_slot: float) -> None:
    s, h, f = 12, 1024, 512
    n = max(4, int(rows_per_slot * s))
    w = _weights(s, h, f, seed=int(rows_per_slot * 10) + fp8, fp8=fp8)
    g = torch.Generator(device="cuda").manual_seed(n)
    src = torch.randn(n + 7, h, device="cuda", generator=g).bfloat16()
    row_of = torch.randint(0, n + 7, (n,), device="cuda", generator=g)
    slot = torch.randint(0, s, (n,), device="cuda", generator=g)
    slot[slot == 3] = 4  # slot 3 empty
    slot[-2:] = s  # padding rows
    scale = torch.rand(n, device="cuda", generator=g)
    valid = slot < s
    ref = _float32(w)  # the reference: dequantised weights, float32 arithmetic
    want = expert_forward(src.float(), row_of, slot, ref, ExpertPlan("loop", n), scale)[valid]
    got = expert_forward(src, row_of, slot, w, ExpertPlan("triton", n), scale).float()[valid]
    assert torch.isfinite(got).all()
    err = float((got - want).norm() / want.norm())
    assert err < 2e-2, err


def test_every_valid_row_is_written() -> None:
    from agents.runtime.triton_experts import moe_ffn

    s, h, f, n = 5, 512, 256, 70
    w = _weights(s, h, f, seed=3, fp8=False)
    x = torch.randn(n, h, device="cuda").bfloat16()
    slot = torch.sort(torch.randint(0, s, (n,), device="cuda")).values
    counts = torch.bincount(slot, minlength=s)
    torch.cuda.synchronize()
    y1 = moe_ffn(x, torch.arange(n, device="cuda"), counts, w.w13, w.w2, None, None, None, 14.0)
    y2 = moe_ffn(x, torch.arange(n, device="cuda"), counts, w.w13, w.w2, None, None, None, 14.0)
    assert torch.isfinite(y1).all()
    assert torch.equal(y1, y2)  # deterministic, no unwritten (random) rows


@pytest.mark.parametrize("expert_dtype", ["bf16", "fp8"])
def test_layer_tunes_its_kernel_and_cuts_the_step_graph_into_phases(expert_dtype: str) -> None:
    layer = gpu_decode_layer(expert_dtype)
    assert layer.plan.kernel in layer.kernel_us
    eager = layer.step().clone()
    layer.capture()
    layer.graphs["layer"].replay()
    torch.cuda.synchronize()
    assert float((layer.st["out"] - eager).abs().max()) < 1e-2
    phases = layer.time_layer_phases(5)
    assert phases is not None
    assert all(phases[p] >= 0 for p in PHASES)
    # medians of each phase, scaled to the step median: their sum is the step within noise
    assert abs(sum(phases[p] for p in PHASES) - phases["layer"]) < 0.02 * phases["layer"]


def test_one_pass_row_quantisation_matches_the_reference() -> None:
    from agents.runtime.experts import _act, _rowwise_fp8
    from agents.runtime.triton_experts import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(37, 2 * 384, device="cuda", generator=g).bfloat16() * 3.0
    scale = torch.rand(37, device="cuda", generator=g)
    for act in (False, True):
        ref_in = _act(x, scale) if act else x
        q, s = quantize_rows(x, act=act, scale=scale if act else None)
        got = q.float() * s[:, None]
        want = ref_in.float()
        assert got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < 4e-2
        _, s_ref = _rowwise_fp8(ref_in)
        assert torch.allclose(s, s_ref, rtol=1e-2)


def test_fp8_grouped_kernel_with_fused_quantisation_matches_the_reference() -> None:
    s, h, f, n = 10, 1024, 512, 300
    w = _weights(s, h, f, seed=11, fp8=True)
    g = torch.Generator(device="cuda").manual_seed(12)
    src = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    slot = torch.randint(0, s, (n,), device="cuda", generator=g)
    slot[-3:] = s
    scale = torch.rand(n, device="cuda", generator=g)
    valid = slot < s
    want = expert_forward(src.float(), None, slot, _float32(w), ExpertPlan("loop", n), scale)
    got = expert_forward(src, None, slot, w, ExpertPlan("grouped", n, align=16), scale).float()
    err = float((got[valid] - want[valid]).norm() / want[valid].norm())
    assert err < 8e-2, err  # activations in FP8 (3 mantissa bits)


@pytest.mark.parametrize("with_scale", [False, True])
def test_one_pass_activation_matches_pytorch(with_scale: bool) -> None:
    """``act_rows`` = ``silu(gate) * up * router weight`` (the BF16 expert path's activation,
    PyTorch's several passes computed in float32), odd widths and rows included."""
    from agents.runtime.triton_experts import act_rows

    g = torch.Generator(device="cuda").manual_seed(7 + with_scale)
    for n, w in ((1, 64), (37, 1536), (300, 2048), (5, 2049)):
        h = torch.randn(n, 2 * w, device="cuda", generator=g).bfloat16()
        scale = torch.rand(n, device="cuda", generator=g) if with_scale else None
        hf = h.float()
        want = torch.nn.functional.silu(hf[:, :w]) * hf[:, w:]
        if scale is not None:
            want = want * scale[:, None]
        got = act_rows(h, scale)
        assert got.dtype == torch.bfloat16 and got.shape == (n, w)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("with_shared", [False, True])
def test_fused_combine_matches_gather_then_sum(with_shared: bool) -> None:
    """``combine_rows`` = residual (+ shared) + each token's top-k expert results gathered
    back from slot order and summed: the combine of a world-size-1 step, in one pass."""
    from agents.runtime.triton_experts import combine_rows

    g = torch.Generator(device="cuda").manual_seed(11 + with_shared)
    for tokens, k, h, spare in ((1, 8, 7168, 0), (33, 8, 4096, 16), (257, 2, 1000, 5)):
        y = torch.randn(tokens * k + spare, h, device="cuda", generator=g).bfloat16()
        index = torch.randperm(tokens * k + spare, device="cuda", generator=g)[: tokens * k]
        a = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
        shared = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
        want = a.float() + y.float()[index].view(tokens, k, h).sum(1)
        if with_shared:
            want = want + shared.float()
        got = combine_rows(y, index, k, a, shared if with_shared else None)
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, h)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
