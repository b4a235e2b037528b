"""The fast runtime (agents.runtime.fast) on CPU: its output equals the single-device
reference for every replica rule and expert kernel, its replica choice is the engine's
(policies.estimate.engines), and two gloo processes give the same result as one. The CUDA-graph
path runs only on a GPU (skipped elsewhere, with the reason)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the fast runtime needs torch (mixfleet[gpu])")

from agents.runtime.experts import (  # noqa: E402
    ExpertPlan,
    ExpertWeights,
    expert_forward,
    expert_plan,
    quantize_experts,
)
from agents.runtime.fast import (  # noqa: E402
    build_fast_layer,
    choose_physical,
    engine_runtime,
    replica_map,
)
from agents.runtime.launch import spawn  # noqa: E402
from agents.runtime.layer import LayerShape, make_weights, reference_forward  # noqa: E402
from agents.runtime.replicas import device_map  # noqa: E402
from agents.runtime.routing import RankPlacement  # noqa: E402
from policies.estimate.replica_choice import served_shares  # noqa: E402

SHAPE = LayerShape(128, 8, 2, 64, 1, 4, 2, 32)
CPU = torch.device("cpu")
# One rank, experts 2 and 5 replicated.
ONE = RankPlacement((12,), ((*((e, 1.0) for e in range(8)), (2, 1.0), (5, 1.0)),))
# Two ranks of 5 slots each, experts 2 and 6 replicated across ranks.
TWO = RankPlacement(
    (7, 5),
    (
        ((0, 1.0), (1, 1.0), (2, 0.3), (3, 1.0), (6, 0.5)),
        ((2, 0.7), (4, 1.0), (5, 1.0), (6, 0.5), (7, 1.0)),
    ),
)


def _has_grouped_mm() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(16, 128, dtype=torch.bfloat16)
        w = torch.randn(2, 128, 64, dtype=torch.bfloat16)
        torch._grouped_mm(x, w, offs=torch.tensor([8, 16], dtype=torch.int32))
    except RuntimeError:
        return False
    return True


def _reference(layer: Any, kv: Any, decode: bool) -> Any:
    w = make_weights(SHAPE, range(SHAPE.num_experts), device="cpu", dtype=torch.float32)
    return reference_forward(
        layer.x, SHAPE, w, decode=decode, seq_len=6, kv_cache=kv, fp8_dispatch=False
    )


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("rule", ["static", "even", "planned"])
def test_one_rank_matches_reference(decode: bool, rule: str) -> None:
    layer = build_fast_layer(
        SHAPE,
        ONE,
        rank=0,
        decode=decode,
        seq_len=6,
        context=16,
        device=CPU,
        dtype=torch.float32,
        rule=rule,
    )
    cache = layer.kv
    kv = (cache[0].clone(), cache[1].clone()) if decode and cache is not None else None
    out = layer.step()
    want = _reference(layer, kv, decode)
    assert float((out - want).abs().max()) < 1e-4


def test_replica_choice_is_the_engines() -> None:
    """Static: the pick of SGLang's map (the first replica on the rank's own GPU); even:
    the shares policies.estimate.replica_choice.served_shares gives."""
    rm = replica_map(TWO, 8, "static")
    assert rm.physical == (0, 1, 2, 3, 6, 2, 4, 5, 6, 7)
    assert rm.static_pick[0][2] == 2 and rm.static_pick[1][2] == 5  # own GPU's replica
    assert rm.static_pick[0][6] == 4 and rm.static_pick[1][6] == 8
    idx = torch.tensor([[2, 6]] * 400)
    for rank in (0, 1):
        phys = choose_physical(idx, device_map(rm, rank, CPU), "static")
        assert set(phys.tolist()) == {rm.static_pick[rank][2], rm.static_pick[rank][6]}
    even = replica_map(TWO, 8, "even")
    want = served_shares(engine_runtime("even", 2), [list(even.physical)], 8, [0.5, 0.5])[0]
    phys = choose_physical(idx, device_map(even, 0, CPU), "even")
    got = torch.bincount(phys, minlength=10).float()
    assert got[2] / 400 == pytest.approx(want[2], abs=0.05)
    assert got[5] / 400 == pytest.approx(want[5], abs=0.05)
    planned = replica_map(TWO, 8, "planned")
    phys = choose_physical(idx, device_map(planned, 0, CPU), "planned")
    got = torch.bincount(phys, minlength=10).float()
    assert got[2] / 400 == pytest.approx(0.3, abs=0.05)
    assert got[5] / 400 == pytest.approx(0.7, abs=0.05)


def test_unequal_slots_and_bad_names_are_refused() -> None:
    bad = RankPlacement((2, 2), (((0, 1.0), (1, 1.0)), ((1, 1.0),)))
    with pytest.raises(ValueError, match="equal slots per rank"):
        replica_map(bad, 2, "even")
    with pytest.raises(ValueError, match="replica rule"):
        replica_map(ONE, 8, "nearest")
    with pytest.raises(ValueError, match="expert kernel"):
        expert_plan("fast", 10, 2, "bf16", cuda=True)
    assert expert_plan("auto", 1024, 128, "bf16", cuda=True).kernel == "capacity"
    assert expert_plan("auto", 65536, 128, "bf16", cuda=True).kernel == "grouped"
    assert expert_plan("auto", 1024, 128, "fp8", cuda=True).align == 16


@pytest.mark.skipif(not _has_grouped_mm(), reason="this torch has no CPU torch._grouped_mm")
def test_grouped_and_capacity_kernels_match_the_loop() -> None:
    g = torch.Generator().manual_seed(0)
    s, h, f, n = 6, 128, 64, 50
    w = ExpertWeights(
        "bf16",
        (torch.randn(s, 2 * f, h, generator=g) / h**0.5).bfloat16(),
        (torch.randn(s, h, f, generator=g) / f**0.5).bfloat16(),
    )
    src = torch.randn(40, h, generator=g).bfloat16()
    row_of = torch.randint(0, 40, (n,), generator=g)
    slot = torch.randint(0, s + 1, (n,), generator=g)  # s: padding rows
    slot[:10] = 0  # overflows a capacity of 4
    scale = torch.rand(n, generator=g)  # each pair's router weight
    valid = slot < s
    want = expert_forward(src, row_of, slot, w, ExpertPlan("loop", n), scale).float()[valid]
    for plan in (
        ExpertPlan("grouped", n),
        ExpertPlan("grouped", n, align=16),
        ExpertPlan("capacity", n, capacity=4),
    ):
        got = expert_forward(src, row_of, slot, w, plan, scale).float()[valid]
        assert float((got - want).abs().max()) < 1e-2, plan


def test_fp8_experts_stay_close_to_bf16() -> None:
    g = torch.Generator().manual_seed(1)
    s, h, f, n = 4, 128, 64, 32
    w13 = torch.randn(s, 2 * f, h, generator=g) / h**0.5
    w2 = torch.randn(s, h, f, generator=g) / f**0.5
    src = torch.randn(n, h, generator=g)
    slot = torch.arange(n) % s
    ref = expert_forward(src, None, slot, ExpertWeights("bf16", w13, w2), ExpertPlan("loop", n))
    got = expert_forward(src, None, slot, quantize_experts(w13, w2), ExpertPlan("loop", n))
    assert float((got - ref).norm() / ref.norm()) < 0.12


def _two_rank_main(rank: int, world: int) -> list[Any]:
    outs = []
    for rule, decode in ((r, d) for r in ("static", "even") for d in (True, False)):
        layer = build_fast_layer(
            SHAPE,
            TWO,
            rank=rank,
            decode=decode,
            seq_len=7 if rank == 0 else 5,
            context=16,
            device=CPU,
            dtype=torch.float32,
            rule=rule,
        )
        cache = layer.kv
        kv = [cache[0].tolist(), cache[1].tolist()] if decode and cache is not None else None
        outs.append((layer.x.tolist(), kv, layer.step().tolist()))
    return outs


def test_two_ranks_over_gloo_match_reference() -> None:
    results = spawn(_two_rank_main, 2, backend="gloo", timeout_s=120)
    for k, (rule, decode) in enumerate((r, d) for r in ("static", "even") for d in (True, False)):
        x = torch.cat([torch.tensor(results[r][k][0]) for r in range(2)])
        got = torch.cat([torch.tensor(results[r][k][2]) for r in range(2)])
        kv = None
        if decode:
            kv = tuple(
                torch.cat([torch.tensor(results[r][k][1][j]) for r in range(2)]) for j in range(2)
            )
        w = make_weights(SHAPE, range(8), device="cpu", dtype=torch.float32)
        want = reference_forward(
            x,
            SHAPE,
            w,
            decode=decode,
            seq_len=7,
            kv_cache=kv,
            fp8_dispatch=False,
            token_offsets=(0, 7),
        )
        assert float((got - want).abs().max()) < 1e-4, (rule, decode)


def gpu_decode_layer(expert_dtype: str) -> Any:
    """A one-rank decode layer on GPU 0 (16 experts, 64 slots, 64 sequences of a 256-token
    context, bfloat16 activations, experts in ``expert_dtype``)."""
    sh = LayerShape(1024, 16, 4, 512, 1, 16, 2, 128)
    pl = RankPlacement((64,), (tuple((e, 1.0) for e in range(16)),))
    return build_fast_layer(
        sh,
        pl,
        rank=0,
        decode=True,
        seq_len=64,
        context=256,
        device=torch.device("cuda", 0),
        dtype=torch.bfloat16,
        expert_dtype=expert_dtype,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU")
@pytest.mark.parametrize("expert_dtype", ["bf16", "fp8"])
def test_graph_replay_equals_eager_on_gpu(expert_dtype: str) -> None:
    layer = gpu_decode_layer(expert_dtype)
    eager = layer.step().clone()
    layer.capture()
    layer.graphs["layer"].replay()
    torch.cuda.synchronize()
    assert float((layer.st["out"] - eager).abs().max()) < 1e-2


def test_two_gpu_bench_on_one_gpu_host_is_an_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    from agents.runtime import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "1 visible CUDA GPU" in err and "--cpu" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
