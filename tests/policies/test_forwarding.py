"""DeepEP's normal kernels send a token once per GPU and once per node (the ``forwarded``
exchange, policies/estimate/forwarding.py), and the engines run them where the model says.

The all-to-all model charged every token-expert pair over RDMA in prefill too: a two-node
prefill with 8 experts per token paid about 4x the RDMA bytes DeepEP's normal kernels move.
"""

from __future__ import annotations

import numpy as np
import pytest
from builders import fleet, request, tiny_model, workload

from policies.estimate.costmodel import CostTable, build_cost_table
from policies.estimate.engines import EngineOptions, EngineSpec, resolve_runtime
from policies.estimate.evaluation import (
    LayerPlacement,
    comm_times_us,
    evaluate,
    exchange_bytes_by_node,
)
from policies.estimate.forwarding import forwarded_times_us, token_copies
from policies.hardware.topology import Channel
from policies.solve import solve

H100 = "H100-SXM5-80GB"


def _table(nodes: int, per_node: int, top_k: int, phase: str = "prefill") -> CostTable:
    model = tiny_model(experts=16, top_k=top_k)
    f = fleet([(f"n{i}", H100, per_node, 900.0) for i in range(nodes)])
    return build_cost_table(f, model, workload(model, phase=phase, tokens=256))


def _uniform(n: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.full(n, 1.0 / n)
    return a, np.outer(a, a)


def test_one_expert_per_token_on_one_node_moves_what_the_pairs_move() -> None:
    """With top-1 routing and no second node there is nothing to deduplicate or forward."""
    table = _table(1, 8, top_k=1)
    a, pairs = _uniform(8)
    assert forwarded_times_us(table, a, pairs) == pytest.approx(
        comm_times_us(table, list(a), list(a))
    )


def test_a_token_goes_once_to_each_gpu_that_holds_one_of_its_experts() -> None:
    """Eight experts per token over eight GPUs: each GPU is hit by 1 - (7/8)^8 of a GPU's
    tokens (65.6%), where the pairs model sends it one copy per expert (8/8 = 1 on
    average)."""
    table = _table(1, 8, top_k=8)
    a, pairs = _uniform(8)
    gpu, node = token_copies(table, a, pairs)
    hit = 1 - (7 / 8) ** 8
    off = ~np.eye(8, dtype=bool)
    assert gpu[off] == pytest.approx(np.full(56, hit / 8))
    assert node.sum() == 0.0  # one node: nothing crosses RDMA
    fw = forwarded_times_us(table, a, pairs)
    pairwise = comm_times_us(table, list(a), list(a))
    alpha = float(table.comm_alpha[0])
    assert (fw[0] - alpha) / (pairwise[0] - alpha) == pytest.approx(hit)


def test_across_two_nodes_a_token_crosses_rdma_once() -> None:
    """Two 8-GPU nodes, eight experts per token spread evenly: a token reaches the other node
    with probability 1 - (1/2)^8; the pairs model sends it 4 copies there. The RDMA time
    falls by that ratio (RDMA is the slowest channel on both sides)."""
    table = _table(2, 8, top_k=8)
    a, pairs = _uniform(16)
    _, node = token_copies(table, a, pairs)
    assert node[0] == pytest.approx([0.0, (1 - 0.5**8) / 16])
    volume = table.total_tokens * table.bytes_per_copy
    rdma = float(table.comm_bw[0, Channel.RDMA])
    expected = (1 - 0.5**8) / 16 * volume / rdma + float(table.comm_alpha[0])
    assert forwarded_times_us(table, a, pairs) == pytest.approx([expected] * 16)
    pair_rdma = 8 * 8 / 16 / 16 * volume / rdma + float(table.comm_alpha[0])
    assert comm_times_us(table, list(a), list(a)) == pytest.approx([pair_rdma] * 16)


def test_tokens_from_another_node_are_forwarded_over_nvlink() -> None:
    """Node n0's GPUs serve nothing and n1's serve everything: every n1 GPU receives its
    tokens from n0 over RDMA at one forwarder and 7/8 of them over NVLink from the other
    forwarders; n0's GPUs only send."""
    table = _table(2, 2, top_k=2)
    a = np.array([0.5, 0.5, 0.0, 0.0])
    served = np.array([0.0, 0.0, 0.5, 0.5])
    pairs = np.outer(a, served)
    gpu, node = token_copies(table, a, pairs)
    per_gpu_hit = 0.5 * (1 - 0.5**2)  # a token of GPU 0 reaches GPU 2 with 1 - (1/2)^2
    assert gpu[0, 2] == pytest.approx(per_gpu_hit)
    assert node[0, 1] == pytest.approx(0.5)  # both experts on n1: always crosses once
    times = forwarded_times_us(table, a, pairs)
    volume = table.total_tokens * table.bytes_per_copy
    rdma = float(table.comm_bw[0, Channel.RDMA])
    nvl = float(table.comm_bw[2, Channel.NVLINK])
    alpha = float(table.comm_alpha[0])
    assert times[0] == pytest.approx(alpha + 0.5 * volume / rdma)  # sends 0.5 to n1
    from_afar = 2 * per_gpu_hit  # into GPU 2 from GPUs 0 and 1
    recv_rdma = 2 * 0.5 / 2  # n1 receives 1.0 of tokens, half at each GPU
    expected = max(recv_rdma * volume / rdma, from_afar / 2 * volume / nvl)
    assert times[2] == pytest.approx(alpha + expected)


def test_node_bytes_count_one_copy_per_node_under_forwarding() -> None:
    """Expert e on GPU e, uniform load: the bytes from one node to the other are 1 - (1/2)^8
    tokens per token under forwarding against 4 pairs."""
    table = _table(2, 8, top_k=8)
    a = [1 / 16] * 16
    layer = LayerPlacement(tuple(((e, 1.0),) for e in range(16)))
    pairs_grid = exchange_bytes_by_node(table, a, [layer], "alltoall")
    fw_grid = exchange_bytes_by_node(table, a, [layer], "forwarded")
    assert fw_grid[0, 1] / pairs_grid[0, 1] == pytest.approx((1 - 0.5**8) / 4)
    assert fw_grid[0, 0] < pairs_grid[0, 0]


def test_engines_run_the_normal_kernels_where_they_do() -> None:
    hopper, nodes = ["hopper"] * 16, ["a"] * 8 + ["b"] * 8
    sglang = resolve_runtime(EngineSpec(name="sglang"), hopper, nodes)
    assert (sglang.exchange_in(False), sglang.exchange_in(True)) == ("forwarded", "alltoall")
    native = resolve_runtime(EngineSpec(name="native"), hopper, nodes)
    assert (native.exchange_in(False), native.exchange_in(True)) == ("forwarded", "alltoall")
    ht = EngineSpec(name="vllm", options=EngineOptions(a2a_backend="deepep_high_throughput"))
    vllm_ht = resolve_runtime(ht, hopper, nodes)
    assert (vllm_ht.exchange_in(False), vllm_ht.exchange_in(True)) == ("forwarded", "forwarded")
    vllm = resolve_runtime(EngineSpec(name="vllm"), hopper, nodes)  # deepep_low_latency
    assert (vllm.exchange_in(False), vllm.exchange_in(True)) == ("alltoall", "alltoall")
    trtllm = resolve_runtime(EngineSpec(name="trtllm"), hopper, nodes)
    assert trtllm.exchange_in(False) == "alltoall"
    ampere = resolve_runtime(EngineSpec(name="sglang"), ["ampere"] * 16, nodes)
    assert ampere.exchange_in(False) == "allgather"


def test_a_two_node_prefill_plan_is_scored_with_the_normal_kernels() -> None:
    """The front door scores a prefill across two nodes with the forwarded exchange: the
    plan's step is what ``evaluate`` gives under it, shorter than under the pair model."""
    model = tiny_model(experts=16, top_k=8)
    f = fleet([("n0", H100, 8, 900.0), ("n1", H100, 8, 900.0)])
    w = workload(model, phase="prefill", tokens=1024)
    result = solve(request(f, model, w, policy="eplb", time_limit_s=5))
    assert result.placed
    plan = result.plan
    table = build_cost_table(f, model, w)
    share = [g.attention_share for g in plan.gpus]
    layers = [
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in plan.gpus))
        for li in range(len(plan.moe_layers))
    ]
    forwarded = evaluate(table, share, layers, "forwarded").step_time_us
    assert plan.summary.step_time_us == pytest.approx(forwarded)
    assert forwarded < evaluate(table, share, layers, "alltoall").step_time_us
