"""Tests for the pure-Python EPLB re-implementation (policies/solvers/eplb_core.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.errors import InputError
from policies.solvers.eplb_core import (
    balanced_packing,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
)

# The worked example from the README of github.com/deepseek-ai/EPLB: 2 layers x 12 experts,
# 16 replicas, 4 groups, 2 nodes, 8 GPUs (hierarchical policy).
README_WEIGHT: list[list[float]] = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


# --------------------------------------------------------------------------- worked example


def test_readme_example_phy2log_exact() -> None:
    phy2log, _, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log == README_PHY2LOG


def test_readme_example_logcnt_and_log2phy() -> None:
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    # Derived from the README phy2log: how often each expert appears in each row.
    assert logcnt == [[row.count(e) for e in range(12)] for row in README_PHY2LOG]
    assert all(len(entry) == 2 for layer in log2phy for entry in layer)
    for layer in range(2):
        for e in range(12):
            slots = [p for p in log2phy[layer][e] if p != -1]
            assert sorted(slots) == [p for p, x in enumerate(phy2log[layer]) if x == e]


def test_readme_example_is_deterministic() -> None:
    assert rebalance_experts(README_WEIGHT, 16, 4, 2, 8) == rebalance_experts(
        README_WEIGHT, 16, 4, 2, 8
    )


# --------------------------------------------------------------------------- building blocks


def test_balanced_packing_small_example() -> None:
    # Heaviest first: 10 -> pack 0, 8 -> pack 1, 5 -> pack 1 (8 < 10), 1 -> pack 0 (only room).
    pack, rank = balanced_packing([1, 5, 8, 10], 2)
    assert pack == [0, 1, 1, 0]
    assert rank == [1, 1, 0, 0]


def test_balanced_packing_ties_by_index() -> None:
    # Equal weights are visited in index order; equal pack loads go to the lowest pack.
    pack, rank = balanced_packing([3, 3, 3, 3], 2)
    assert pack == [0, 1, 0, 1]
    assert rank == [0, 0, 1, 1]


def test_balanced_packing_one_item_per_pack_is_identity() -> None:
    # Upstream short-cut: no sorting when each pack takes a single item.
    pack, rank = balanced_packing([1, 9, 4], 3)
    assert pack == [0, 1, 2]
    assert rank == [0, 0, 0]


def test_replicate_experts_small_example() -> None:
    phy2log, rank, logcnt = replicate_experts([10, 4, 6], 6)
    # Extras: 10 (10 > 6), 6 (6 > 5), 10 (5 > 4 and 5 > 3: 10/2=5 vs 6/2=3).
    assert phy2log == [0, 1, 2, 0, 2, 0]
    assert rank == [0, 0, 0, 1, 1, 2]
    assert logcnt == [3, 1, 2]


def test_replicate_experts_ties_pick_first_index() -> None:
    phy2log, _, logcnt = replicate_experts([5, 5, 5], 5)
    assert phy2log == [0, 1, 2, 0, 1]
    assert logcnt == [2, 2, 1]


def test_global_policy_matches_hierarchical_with_one_group_one_node() -> None:
    # 3 groups on 2 nodes: not divisible, so the global policy is used.
    weight: list[list[float]] = [[7, 1, 3, 9, 2, 8], [1, 1, 4, 4, 6, 0]]
    phy2log, _, logcnt = rebalance_experts(weight, 8, 3, 2, 4)
    ref_phy2log, _, ref_logcnt = rebalance_experts_hierarchical(weight, 8, 1, 1, 4)
    assert phy2log == ref_phy2log
    assert logcnt == ref_logcnt


# --------------------------------------------------------------------------- properties


@st.composite
def eplb_cases(
    draw: st.DrawFn, hierarchical: bool = False
) -> tuple[list[list[float]], int, int, int, int]:
    """Random valid (weight, num_replicas, num_groups, num_nodes, num_gpus).

    With ``hierarchical`` the group count is a multiple of the node count; otherwise it is
    arbitrary, so both the hierarchical and the global policy are exercised.
    """
    num_nodes = draw(st.integers(1, 3))
    gpus_per_node = draw(st.integers(1, 4))
    num_gpus = num_nodes * gpus_per_node
    num_groups = num_nodes * draw(st.integers(1, 3)) if hierarchical else draw(st.integers(1, 6))
    group_size = draw(st.integers(1, 4))
    num_experts = num_groups * group_size
    slots_per_gpu_min = -(-num_experts // num_gpus)
    slots_per_gpu = draw(st.integers(slots_per_gpu_min, slots_per_gpu_min + 3))
    num_replicas = slots_per_gpu * num_gpus
    num_layers = draw(st.integers(1, 3))
    load = st.one_of(
        st.integers(0, 50).map(float),
        st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
    )
    weight = draw(
        st.lists(
            st.lists(load, min_size=num_experts, max_size=num_experts),
            min_size=num_layers,
            max_size=num_layers,
        )
    )
    return weight, num_replicas, num_groups, num_nodes, num_gpus


@settings(max_examples=300, deadline=None)
@given(eplb_cases())
def test_rebalance_invariants(case: tuple[list[list[float]], int, int, int, int]) -> None:
    weight, num_replicas, num_groups, num_nodes, num_gpus = case
    num_experts = len(weight[0])
    phy2log, log2phy, logcnt = rebalance_experts(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    max_cnt = max(max(row) for row in logcnt)
    slots_per_gpu = num_replicas // num_gpus
    assert len(phy2log) == len(log2phy) == len(logcnt) == len(weight)
    for layer, row in enumerate(weight):
        p2l, l2p, cnt = phy2log[layer], log2phy[layer], logcnt[layer]
        assert len(p2l) == num_replicas
        assert len(cnt) == num_experts
        # Every logical expert has at least one replica; counts add up to the slot count.
        assert all(c >= 1 for c in cnt)
        assert sum(cnt) == num_replicas
        assert cnt == [p2l.count(e) for e in range(num_experts)]
        # log2phy is the inverse of phy2log, padded with -1 to the global max count.
        assert len(l2p) == num_experts
        for e in range(num_experts):
            assert len(l2p[e]) == max_cnt
            assert l2p[e][: cnt[e]] == [x for x in l2p[e] if x != -1]
            assert all(x == -1 for x in l2p[e][cnt[e] :])
            assert sorted(l2p[e][: cnt[e]]) == [p for p, x in enumerate(p2l) if x == e]
        # Each GPU holds exactly num_replicas / num_gpus slots (contiguous blocks).
        gpu_of_slot = [p // slots_per_gpu for p in range(num_replicas)]
        assert all(gpu_of_slot.count(g) == slots_per_gpu for g in range(num_gpus))
        # Replication never raises the maximum load per replica.
        before = max(row)
        after = max(w / c for w, c in zip(row, cnt, strict=True))
        assert after <= before


@settings(max_examples=300, deadline=None)
@given(eplb_cases(hierarchical=True))
def test_hierarchical_keeps_groups_on_nodes(
    case: tuple[list[list[float]], int, int, int, int],
) -> None:
    weight, num_replicas, num_groups, num_nodes, num_gpus = case
    assert num_groups % num_nodes == 0
    num_experts = len(weight[0])
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_node = num_replicas // num_nodes
    phy2log, _, _ = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    for p2l in phy2log:
        seen: set[int] = set()
        for node in range(num_nodes):
            # GPUs of node k hold slots [k * slots_per_node, (k + 1) * slots_per_node).
            experts = p2l[node * slots_per_node : (node + 1) * slots_per_node]
            groups = {e // group_size for e in experts}
            # The node holds whole groups: every expert of each of its groups, nothing else.
            assert len(groups) == groups_per_node
            assert set(experts) == {g * group_size + j for g in groups for j in range(group_size)}
            assert not groups & seen
            seen |= groups
        assert seen == set(range(num_groups))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=12),
    st.integers(0, 20),
)
def test_replicate_experts_is_optimal(weight: list[int], extra: int) -> None:
    num_phy = len(weight) + extra
    phy2log, rank, logcnt = replicate_experts([float(w) for w in weight], num_phy)
    assert sum(logcnt) == num_phy
    assert all(c >= 1 for c in logcnt)
    assert logcnt == [phy2log.count(e) for e in range(len(weight))]
    for e, c in enumerate(logcnt):
        assert sorted(r for p, r in enumerate(rank) if phy2log[p] == e) == list(range(c))
    # No allocation of num_phy replicas (>= 1 each) gets every load per replica below the
    # greedy's maximum: getting w / c < m needs c = floor(w / m) + 1 replicas.
    m = max(Fraction(w, c) for w, c in zip(weight, logcnt, strict=True))
    if m > 0:
        assert sum(max(1, math.floor(Fraction(w) / m) + 1) for w in weight) > num_phy


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda packs: st.tuples(
            st.just(packs),
            st.integers(1, 5).flatmap(
                lambda per: st.lists(
                    st.integers(0, 100).map(float), min_size=packs * per, max_size=packs * per
                )
            ),
        )
    )
)
def test_balanced_packing_fills_packs_exactly(case: tuple[int, list[float]]) -> None:
    num_packs, weight = case
    per_pack = len(weight) // num_packs
    pack, rank = balanced_packing(weight, num_packs)
    for k in range(num_packs):
        ranks = sorted(r for i, r in enumerate(rank) if pack[i] == k)
        assert ranks == list(range(per_pack))


# --------------------------------------------------------------------------- input errors


def _raises(fn: Callable[..., Any], *args: Any, field: str, words: str) -> None:
    with pytest.raises(InputError) as info:
        fn(*args)
    assert info.value.field == field
    assert "To fix:" in str(info.value)
    assert words in str(info.value)


def test_error_replicas_not_divisible_by_gpus() -> None:
    _raises(rebalance_experts, README_WEIGHT, 15, 4, 2, 8, field="num_replicas", words="divisible")


def test_error_gpus_not_divisible_by_nodes() -> None:
    _raises(rebalance_experts, README_WEIGHT, 16, 4, 3, 8, field="num_gpus", words="num_nodes")


def test_error_fewer_replicas_than_experts() -> None:
    _raises(rebalance_experts, README_WEIGHT, 8, 4, 2, 8, field="num_replicas", words=">= 12")


def test_error_experts_not_divisible_by_groups() -> None:
    _raises(rebalance_experts, README_WEIGHT, 16, 5, 1, 8, field="num_groups", words="groups")


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_error_bad_weight(bad: float) -> None:
    weight = [list(row) for row in README_WEIGHT]
    weight[1][3] = bad
    _raises(rebalance_experts, weight, 16, 4, 2, 8, field="weight[1][3]", words="load")


def test_error_ragged_rows() -> None:
    weight = [list(README_WEIGHT[0]), README_WEIGHT[1][:11]]
    _raises(rebalance_experts, weight, 16, 4, 2, 8, field="weight[1]", words="ragged")


def test_error_empty_weight() -> None:
    _raises(rebalance_experts, [], 16, 4, 2, 8, field="weight", words="layer")
    _raises(rebalance_experts, [[]], 16, 4, 2, 8, field="weight[0]", words="experts")


@pytest.mark.parametrize("name", ["num_replicas", "num_groups", "num_nodes", "num_gpus"])
def test_error_non_positive_size(name: str) -> None:
    sizes = {"num_replicas": 16, "num_groups": 4, "num_nodes": 2, "num_gpus": 8}
    sizes[name] = 0
    _raises(
        rebalance_experts,
        README_WEIGHT,
        sizes["num_replicas"],
        sizes["num_groups"],
        sizes["num_nodes"],
        sizes["num_gpus"],
        field=name,
        words="positive",
    )


def test_error_hierarchical_groups_not_divisible_by_nodes() -> None:
    _raises(
        rebalance_experts_hierarchical,
        README_WEIGHT,
        16,
        3,
        2,
        8,
        field="num_groups",
        words="global",
    )


def test_error_building_blocks() -> None:
    _raises(balanced_packing, [1.0, 2.0, 3.0], 2, field="num_packs", words="evenly")
    _raises(replicate_experts, [1.0, 2.0, 3.0], 2, field="num_phy", words=">= 3")
    _raises(replicate_experts, [1.0, -2.0], 3, field="weight[1]", words=">= 0")
