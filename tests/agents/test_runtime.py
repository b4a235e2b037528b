"""The reference runtime on CPU: distributed output equals the single-device reference.

Runs 2 and 3 gloo processes with small dimensions, unequal numbers of experts per rank,
replicated experts with unequal token shares and unequal attention shares, in decode and
prefill, with and without FP8 dispatch.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the reference runtime needs torch (mixfleet[gpu])")

from agents.runtime.launch import spawn  # noqa: E402
from agents.runtime.layer import (  # noqa: E402
    LayerShape,
    MoeLayer,
    make_kv_cache,
    make_weights,
    reference_forward,
)
from agents.runtime.routing import (  # noqa: E402
    FP8_GROUP,
    RankPlacement,
    assign_replicas,
    build_tables,
    fp8_roundtrip,
    split_tokens,
)

SHAPE = LayerShape(
    hidden=128,
    num_experts=8,
    top_k=2,
    expert_ffn=64,
    num_shared_experts=1,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
)
CONTEXT = 16
SEQ_LEN = 6

# Unequal experts per rank; experts 2 and 3 replicated with unequal shares.
PLACEMENTS = {
    2: RankPlacement(
        tokens=(13, 7),
        slots=(
            ((0, 1.0), (1, 1.0), (2, 0.3), (3, 1.0), (4, 1.0)),
            ((2, 0.7), (5, 1.0), (6, 1.0), (7, 1.0)),
        ),
    ),
    3: RankPlacement(
        tokens=(9, 4, 11),
        slots=(
            ((0, 1.0), (2, 0.25), (1, 1.0)),
            ((2, 0.75), (3, 0.6)),
            ((3, 0.4), (4, 1.0), (5, 1.0), (6, 1.0), (7, 1.0)),
        ),
    ),
}
SCENARIOS = [(True, False), (True, True), (False, False), (False, True)]  # (decode, fp8)


def _inputs(total: int) -> Any:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(total, SHAPE.hidden, generator=g)


def _expected(placement: RankPlacement, decode: bool, fp8: bool) -> Any:
    total = sum(placement.tokens)
    x = _inputs(total)
    w = make_weights(SHAPE, range(SHAPE.num_experts), device="cpu", dtype=torch.float32)
    cache = make_kv_cache(SHAPE, total, CONTEXT, device="cpu", dtype=torch.float32, seed=5)
    offsets = [sum(placement.tokens[:r]) for r in range(placement.world)]
    return reference_forward(
        x,
        SHAPE,
        w,
        decode=decode,
        seq_len=SEQ_LEN,
        kv_cache=cache if decode else None,
        fp8_dispatch=fp8,
        token_offsets=offsets,
    )


def _rank_main(rank: int, world: int, placement: RankPlacement) -> list[list[list[float]]]:
    """Each scenario's output rows of this rank."""
    total = sum(placement.tokens)
    lo = sum(placement.tokens[:rank])
    hi = lo + placement.tokens[rank]
    experts = [e for e, _ in placement.slots[rank]]
    w = make_weights(SHAPE, experts, device="cpu", dtype=torch.float32)
    tables = build_tables(placement, SHAPE.num_experts, "cpu")
    outs = []
    for decode, fp8 in SCENARIOS:
        x = _inputs(total)[lo:hi]
        k, v = make_kv_cache(SHAPE, total, CONTEXT, device="cpu", dtype=torch.float32, seed=5)
        layer = MoeLayer(
            SHAPE,
            placement,
            rank,
            world,
            w,
            tables,
            decode=decode,
            seq_len=SEQ_LEN,
            fp8_dispatch=fp8,
            sync_phases=fp8,
        )
        y = layer.forward(x, (k[lo:hi], v[lo:hi]) if decode else None)
        outs.append(y.tolist())
    return outs


def _rel_err(got: Any, want: Any) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_layer_matches_reference(world: int) -> None:
    placement = PLACEMENTS[world]
    results = spawn(_rank_main, world, placement, backend="gloo", timeout_s=120)
    for k, (decode, fp8) in enumerate(SCENARIOS):
        got = torch.cat([torch.tensor(results[r][k]) for r in range(world)])
        want = _expected(placement, decode, fp8)
        assert got.shape == want.shape
        assert torch.isfinite(got).all()
        err = _rel_err(got, want)
        assert err < 1e-4, f"world {world} decode={decode} fp8={fp8}: relative error {err:.2e}"


def test_single_process_layer_matches_reference_and_shares_split() -> None:
    placement = RankPlacement(tokens=(10,), slots=(tuple((e, 1.0) for e in range(8)),))
    w = make_weights(SHAPE, range(8), device="cpu", dtype=torch.float32)
    tables = build_tables(placement, 8, "cpu")
    layer = MoeLayer(SHAPE, placement, 0, 1, w, tables, decode=False, seq_len=4)
    x = _inputs(10)
    want = reference_forward(
        x, SHAPE, w, decode=False, seq_len=4, kv_cache=None, fp8_dispatch=False
    )
    assert _rel_err(layer.forward(x), want) < 1e-5


def test_replicas_take_their_shares_of_pairs() -> None:
    placement = RankPlacement(tokens=(500, 500), slots=(((0, 0.3), (1, 1.0)), ((0, 0.7),)))
    tables = build_tables(placement, 2, "cpu")
    idx = torch.zeros(1000, 1, dtype=torch.int64)  # every pair to expert 0
    ranks, slots = assign_replicas(idx, tables)
    assert int((ranks == 0).sum()) == 300
    assert int((ranks == 1).sum()) == 700
    assert set(slots[ranks == 0].tolist()) == {0}
    idx = torch.ones(10, 1, dtype=torch.int64)  # expert 1 lives on rank 0, slot 1 only
    ranks, slots = assign_replicas(idx, tables)
    assert ranks.tolist() == [0] * 10
    assert slots.tolist() == [1] * 10


def test_missing_expert_is_reported() -> None:
    placement = RankPlacement(tokens=(4,), slots=(((0, 1.0),),))
    with pytest.raises(ValueError, match=r"experts \[1\] have no replica"):
        build_tables(placement, 2, "cpu")


def test_split_tokens_and_fp8_wire() -> None:
    assert split_tokens(10, [0.5, 0.5]) == (5, 5)
    assert split_tokens(10, [0.66, 0.34]) == (7, 3)
    assert sum(split_tokens(8192, [0.1234, 0.4, 0.4766])) == 8192
    x = torch.randn(5, 2 * FP8_GROUP) * 3.0
    y = fp8_roundtrip(x)
    # float8_e4m3fn keeps 3 mantissa bits: relative error per value below 2**-4.
    assert float(((y - x).abs() / x.abs().clamp(min=1e-3)).median()) < 2**-4
    assert float((y - x).norm() / x.norm()) < 0.05


def _gpus() -> int:
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


GPU_SHAPE = LayerShape(
    hidden=1024,
    num_experts=16,
    top_k=4,
    expert_ffn=256,
    num_shared_experts=1,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=128,
)
GPU_PLACEMENT = RankPlacement(
    tokens=(40, 24),
    slots=(
        (*((e, 1.0) for e in range(10)), (10, 0.5)),
        ((10, 0.5), *((e, 1.0) for e in range(11, 16))),
    ),
)


def _gpu_rank(rank: int, world: int, decode: bool, fp8: bool) -> list[list[float]]:
    dev = torch.device("cuda", rank)
    p = GPU_PLACEMENT
    total = sum(p.tokens)
    lo, hi = sum(p.tokens[:rank]), sum(p.tokens[: rank + 1])
    w = make_weights(GPU_SHAPE, [e for e, _ in p.slots[rank]], device=dev, dtype=torch.bfloat16)
    layer = MoeLayer(
        GPU_SHAPE,
        p,
        rank,
        world,
        w,
        build_tables(p, GPU_SHAPE.num_experts, dev),
        decode=decode,
        seq_len=16,
        fp8_dispatch=fp8,
    )
    x = _gpu_inputs(total).to(dev)[lo:hi]
    k, v = make_kv_cache(GPU_SHAPE, total, 64, device="cpu", dtype=torch.bfloat16, seed=9)
    cache = (k[lo:hi].to(dev), v[lo:hi].to(dev)) if decode else None
    out: list[list[float]] = layer.forward(x, cache).float().cpu().tolist()
    return out


def _gpu_inputs(total: int) -> Any:
    g = torch.Generator().manual_seed(99)
    return torch.randn(total, GPU_SHAPE.hidden, generator=g).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (NCCL, grouped GEMM, flash SDPA)")
@pytest.mark.parametrize(("decode", "fp8"), [(True, True), (False, False)])
def test_nccl_layer_matches_reference_on_gpus(decode: bool, fp8: bool) -> None:
    results = spawn(_gpu_rank, 2, decode, fp8, backend="nccl", timeout_s=300)
    got = torch.tensor(results[0] + results[1])
    dev = torch.device("cuda", 0)
    total = sum(GPU_PLACEMENT.tokens)
    w = make_weights(GPU_SHAPE, range(16), device=dev, dtype=torch.bfloat16)
    k, v = make_kv_cache(GPU_SHAPE, total, 64, device="cpu", dtype=torch.bfloat16, seed=9)
    want = (
        reference_forward(
            _gpu_inputs(total).to(dev),
            GPU_SHAPE,
            w,
            decode=decode,
            seq_len=16,
            kv_cache=(k.to(dev), v.to(dev)) if decode else None,
            fp8_dispatch=fp8,
            token_offsets=(0, GPU_PLACEMENT.tokens[0]),
        )
        .float()
        .cpu()
    )
    assert torch.isfinite(got).all()
    # bf16 compute: a token whose 4th and 5th router logits nearly tie may pick another
    # expert on one side (rounding differs between a rank's slice and the whole batch), so
    # judge per token: nearly all tokens match closely.
    per_token = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(per_token.median()) < 1e-2, per_token
    assert float((per_token < 3e-2).float().mean()) >= 0.9, per_token
