"""Pure-Python re-implementation of DeepSeek's Expert Parallelism Load Balancer (EPLB).

This is our own rewrite of the algorithm in ``eplb.py`` from github.com/deepseek-ai/EPLB,
with plain lists instead of torch tensors, and with the same arithmetic order and the same
tie-breaking, so that it yields the same plans (the README's worked example is reproduced
exactly; see ``tests/policies/test_eplb_core.py``). It is the baseline our heterogeneity-aware
solvers are compared against.

The algorithm, for each MoE layer independently, given an estimated load (token count) per
logical expert:

1. **Pack groups to nodes** (hierarchical policy only). The logical experts are split into
   ``num_groups`` contiguous groups (DeepSeek-V3's group-limited routing); the group loads
   are packed onto ``num_nodes`` nodes with :func:`balanced_packing`, so that every node gets
   the same number of groups and the node loads are as even as the greedy allows. This keeps
   a group's experts on one node and so limits inter-node traffic.
2. **Replicate experts within each node.** Each node receives ``num_replicas / num_nodes``
   physical slots; :func:`replicate_experts` gives every expert of the node one replica and
   hands each redundant slot to the expert with the highest load per replica. A replica is
   assumed to serve ``load / replica_count`` tokens.
3. **Pack replicas to GPUs.** The replicas of each node are packed onto the node's
   ``num_gpus / num_nodes`` GPUs with :func:`balanced_packing`, exactly
   ``num_replicas / num_gpus`` slots per GPU.

When ``num_groups`` is not a multiple of ``num_nodes`` the groups cannot be kept on nodes
and :func:`rebalance_experts` falls back to the *global* policy: the same three steps with a
single group and a single node (as the current upstream ``eplb.py`` does).

Physical slot ``p`` of a layer lives on GPU ``p // (num_replicas // num_gpus)`` and GPU
``g`` lives on node ``g // (num_gpus // num_nodes)``.

What it assumes and ignores (the reasons a mixed fleet needs more than EPLB):

* all GPUs are identical: equal speed, equal slot count, so "balanced" means equal tokens;
* memory is not modelled: a slot is a slot, whatever the expert's size or the GPU's HBM;
* the previous placement is ignored: every call plans from scratch, with no regard for how
  many experts have to move;
* loads are estimates supplied by the caller, and a replica gets an equal share of its
  expert's tokens.

Tie-breaking (matching upstream, documented so results are deterministic):

* :func:`balanced_packing` visits items by descending weight; upstream uses torch's
  ``sort(descending=True)``, whose CPU sort keeps equal keys in index order. We use a stable
  sort by descending weight, so equal weights are visited lowest index first. The target is
  the lightest pack that still has room, the lowest pack index on ties (Python ``min``).
* :func:`replicate_experts` gives each redundant slot to the expert with the largest
  ``load / replicas``, the lowest expert index on ties (torch ``max(dim=-1)`` / ``argmax``
  returns the first maximal index).

Numerics: upstream computes in float32; we compute in Python floats (float64). Results can
only differ where two candidate values are equal in one precision and not in the other.

No I/O, no logging; invalid input raises :class:`policies.errors.InputError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.errors import InputError

__all__ = [
    "balanced_packing",
    "rebalance_experts",
    "rebalance_experts_hierarchical",
    "replicate_experts",
]


# --------------------------------------------------------------------------- validation


def _check_positive_int(value: int, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(
            f"must be a positive integer, got {value!r}. To fix: pass an integer >= 1.",
            field=field,
        )


def _check_row(row: Sequence[float], field: str) -> None:
    for j, w in enumerate(row):
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise InputError(
                f"load must be a number, got {w!r}. "
                "To fix: pass token counts (int or float) per expert.",
                field=f"{field}[{j}]",
            )
        if math.isnan(w) or math.isinf(w):
            raise InputError(
                f"load must be finite, got {w!r}. "
                "To fix: replace NaN/infinite expert loads with measured token counts (use 0 "
                "for an expert with no traffic).",
                field=f"{field}[{j}]",
            )
        if w < 0:
            raise InputError(
                f"load must be >= 0, got {w!r}. "
                "To fix: expert loads are token counts; clamp negative estimates to 0.",
                field=f"{field}[{j}]",
            )


def _check_matrix(weight: Sequence[Sequence[float]]) -> int:
    """Validate ``weight`` [layers][experts]; return the number of experts."""
    if len(weight) == 0:
        raise InputError(
            "no MoE layers given. To fix: pass one row of expert loads per MoE layer.",
            field="weight",
        )
    num_experts = len(weight[0])
    if num_experts == 0:
        raise InputError(
            "layer 0 has no experts. To fix: pass one load per logical expert.",
            field="weight[0]",
        )
    for i, row in enumerate(weight):
        if len(row) != num_experts:
            raise InputError(
                f"ragged load matrix: layer {i} has {len(row)} experts, layer 0 has "
                f"{num_experts}. To fix: every layer must list a load for each of the same "
                "logical experts.",
                field=f"weight[{i}]",
            )
        _check_row(row, f"weight[{i}]")
    return num_experts


def _check_shape(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    _check_positive_int(num_replicas, "num_replicas")
    _check_positive_int(num_groups, "num_groups")
    _check_positive_int(num_nodes, "num_nodes")
    _check_positive_int(num_gpus, "num_gpus")
    if num_gpus % num_nodes != 0:
        raise InputError(
            f"num_gpus={num_gpus} is not divisible by num_nodes={num_nodes}. "
            "To fix: every node must hold the same number of GPUs; pass num_gpus as a "
            "multiple of num_nodes.",
            field="num_gpus",
        )
    if num_replicas % num_gpus != 0:
        raise InputError(
            f"num_replicas={num_replicas} is not divisible by num_gpus={num_gpus}. "
            "To fix: every GPU gets the same number of expert slots; pass num_replicas as a "
            f"multiple of {num_gpus} (e.g. {-(-num_replicas // num_gpus) * num_gpus}).",
            field="num_replicas",
        )
    if num_replicas < num_experts:
        raise InputError(
            f"num_replicas={num_replicas} is smaller than the number of logical experts "
            f"({num_experts}). To fix: every expert needs at least one replica; pass "
            f"num_replicas >= {num_experts}.",
            field="num_replicas",
        )
    if num_experts % num_groups != 0:
        raise InputError(
            f"{num_experts} logical experts cannot be split into num_groups={num_groups} "
            "equal groups. To fix: pass the model's expert-group count (n_group), which "
            "divides the expert count, or 1 for a model without group-limited routing.",
            field="num_groups",
        )


# --------------------------------------------------------------------------- building blocks


def _inverse(perm: Sequence[int]) -> list[int]:
    """Inverse of a permutation of ``range(len(perm))``."""
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _balanced_packing(weight: Sequence[float], num_packs: int) -> tuple[list[int], list[int]]:
    n = len(weight)
    items_per_pack = n // num_packs
    if items_per_pack == 1:
        # Upstream short-cut: one item per pack keeps the identity order (no sorting).
        return list(range(n)), [0] * n
    # Stable sort by descending weight == torch CPU sort(descending=True): ties by index.
    order = sorted(range(n), key=lambda j: -weight[j])
    pack_index = [-1] * n
    rank_in_pack = [-1] * n
    pack_weights = [0.0] * num_packs
    pack_items = [0] * num_packs
    for item in order:
        # Lightest pack with room; min() returns the first (lowest index) on ties.
        pack = min(
            (k for k in range(num_packs) if pack_items[k] < items_per_pack),
            key=pack_weights.__getitem__,
        )
        pack_index[item] = pack
        rank_in_pack[item] = pack_items[pack]
        pack_weights[pack] += weight[item]
        pack_items[pack] += 1
    return pack_index, rank_in_pack


def balanced_packing(weight: Sequence[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items.

    Greedy: items are visited heaviest first (stable: equal weights in index order) and each
    goes to the currently lightest pack that still has room (lowest pack index on ties).
    With one item per pack, item ``j`` goes to pack ``j`` (upstream's short-cut, no sort).

    Args:
        weight: ``[n]``, the weight of each item (finite, >= 0).
        num_packs: number of packs; must divide ``n``.

    Returns:
        ``(pack_index, rank_in_pack)``, both ``[n]``: the pack of each item and its position
        (0-based, in placement order) inside that pack.

    Raises:
        InputError: on an invalid weight or a ``num_packs`` that does not divide ``n``.
    """
    _check_positive_int(num_packs, "num_packs")
    _check_row(weight, "weight")
    if len(weight) % num_packs != 0:
        raise InputError(
            f"{len(weight)} items cannot be split evenly into num_packs={num_packs} packs. "
            "To fix: pass a pack count that divides the number of items.",
            field="num_packs",
        )
    return _balanced_packing(weight, num_packs)


def _replicate_experts(
    weight: Sequence[float], num_phy: int
) -> tuple[list[int], list[int], list[int]]:
    num_log = len(weight)
    phy2log = list(range(num_log))
    rank = [0] * num_log
    logcnt = [1] * num_log
    for _ in range(num_log, num_phy):
        # argmax of load per replica; strict '>' keeps the first index on ties.
        best = 0
        best_load = weight[0] / logcnt[0]
        for j in range(1, num_log):
            load = weight[j] / logcnt[j]
            if load > best_load:
                best, best_load = j, load
        phy2log.append(best)
        rank.append(logcnt[best])
        logcnt[best] += 1
    return phy2log, rank, logcnt


def replicate_experts(
    weight: Sequence[float], num_phy: int
) -> tuple[list[int], list[int], list[int]]:
    """Replicate ``num_log`` logical experts into ``num_phy`` physical replicas.

    Every expert starts with one replica (physical ``j`` = logical ``j`` for
    ``j < num_log``); each further replica goes to the expert with the largest load per
    replica, ``weight[j] / logcnt[j]`` (lowest index on ties). This greedy minimises the
    maximum load per replica.

    Args:
        weight: ``[num_log]``, load of each logical expert (finite, >= 0).
        num_phy: number of physical replicas, ``>= num_log``.

    Returns:
        ``(phy2log, rank, logcnt)``: ``phy2log`` ``[num_phy]`` the logical expert of each
        replica; ``rank`` ``[num_phy]`` the replica's index among its expert's replicas;
        ``logcnt`` ``[num_log]`` the replica count of each expert (sums to ``num_phy``).

    Raises:
        InputError: on an invalid weight or ``num_phy < num_log``.
    """
    if len(weight) == 0:
        raise InputError(
            "no experts given. To fix: pass one load per logical expert.", field="weight"
        )
    _check_row(weight, "weight")
    _check_positive_int(num_phy, "num_phy")
    if num_phy < len(weight):
        raise InputError(
            f"num_phy={num_phy} is smaller than the number of logical experts "
            f"({len(weight)}). To fix: pass num_phy >= {len(weight)}.",
            field="num_phy",
        )
    return _replicate_experts(weight, num_phy)


def _hierarchical_layer(
    weight: Sequence[float],
    num_physical_experts: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[list[int], list[int], list[int]]:
    """One layer of :func:`rebalance_experts_hierarchical` (inputs already validated)."""
    num_log = len(weight)
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_log // num_nodes
    phy_per_node = num_physical_experts // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy_per_gpu = num_physical_experts // num_gpus

    # Step 1: pack groups to nodes. "mlog" numbers logical experts node-major: node k owns
    # mlog ids [k * log_per_node, (k + 1) * log_per_node), groups kept contiguous.
    tokens_per_group = [
        sum(weight[g * group_size : (g + 1) * group_size]) for g in range(num_groups)
    ]
    group_pack, group_rank = _balanced_packing(tokens_per_group, num_nodes)
    log2mlog = [
        (group_pack[e // group_size] * groups_per_node + group_rank[e // group_size]) * group_size
        + e % group_size
        for e in range(num_log)
    ]
    mlog2log = _inverse(log2mlog)

    phy2log: list[int] = []
    phyrank: list[int] = []
    mlogcnt: list[int] = []
    for node in range(num_nodes):
        base = node * log_per_node
        # Step 2: replicate this node's experts onto its physical slots.
        tokens_per_mlog = [weight[mlog2log[base + j]] for j in range(log_per_node)]
        phy2mlog, rank, cnt = _replicate_experts(tokens_per_mlog, phy_per_node)
        mlogcnt.extend(cnt)

        # Step 3: pack this node's replicas onto its GPUs (load of a replica = load / count).
        tokens_per_phy = [tokens_per_mlog[m] / cnt[m] for m in phy2mlog]
        pack_index, rank_in_pack = _balanced_packing(tokens_per_phy, gpus_per_node)
        phy2pphy = [pack_index[p] * phy_per_gpu + rank_in_pack[p] for p in range(phy_per_node)]
        pphy2phy = _inverse(phy2pphy)
        for q in range(phy_per_node):
            p = pphy2phy[q]
            phy2log.append(mlog2log[base + phy2mlog[p]])
            phyrank.append(rank[p])

    logcnt = [mlogcnt[log2mlog[e]] for e in range(num_log)]
    return phy2log, phyrank, logcnt


def rebalance_experts_hierarchical(
    weight: Sequence[Sequence[float]],
    num_physical_experts: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Hierarchical EPLB: groups to nodes, replicas within nodes, replicas to GPUs.

    Args:
        weight: ``[num_layers][num_logical_experts]``, load of each logical expert per layer.
        num_physical_experts: physical expert slots per layer; a multiple of ``num_gpus``
            and ``>= num_logical_experts``.
        num_groups: expert groups; must divide ``num_logical_experts`` and be a multiple of
            ``num_nodes``.
        num_nodes: server nodes (fast intra-node network, e.g. NVLink).
        num_gpus: GPUs in total; a multiple of ``num_nodes``.

    Returns:
        ``(phy2log, phyrank, logcnt)``: ``phy2log`` ``[num_layers][num_physical_experts]``
        the logical expert in each slot; ``phyrank`` ``[num_layers][num_physical_experts]``
        the slot's replica index among its expert's replicas; ``logcnt``
        ``[num_layers][num_logical_experts]`` the replica count of each expert.

    Raises:
        InputError: on invalid loads or sizes (see :func:`rebalance_experts`), or when
            ``num_groups`` is not a multiple of ``num_nodes``.
    """
    num_log = _check_matrix(weight)
    _check_shape(num_log, num_physical_experts, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes != 0:
        raise InputError(
            f"num_groups={num_groups} is not divisible by num_nodes={num_nodes}, so groups "
            "cannot be kept within nodes. To fix: use rebalance_experts, which falls back "
            "to the global policy, or pass a num_groups that is a multiple of num_nodes.",
            field="num_groups",
        )
    phy2log: list[list[int]] = []
    phyrank: list[list[int]] = []
    logcnt: list[list[int]] = []
    for row in weight:
        p2l, rank, cnt = _hierarchical_layer(
            [float(w) for w in row], num_physical_experts, num_groups, num_nodes, num_gpus
        )
        phy2log.append(p2l)
        phyrank.append(rank)
        logcnt.append(cnt)
    return phy2log, phyrank, logcnt


def rebalance_experts(
    weight: Sequence[Sequence[float]],
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
    """EPLB entry point: replicate and place the experts of every MoE layer.

    Uses the hierarchical policy when ``num_groups % num_nodes == 0``, else the global
    policy (hierarchical with one group and one node).

    Args:
        weight: ``[num_layers][num_logical_experts]``, estimated load of each logical expert
            (finite, >= 0; all rows the same length).
        num_replicas: physical expert slots per layer; a multiple of ``num_gpus`` and
            ``>= num_logical_experts``.
        num_groups: expert groups of the model; must divide ``num_logical_experts``.
        num_nodes: server nodes.
        num_gpus: GPUs in total; a multiple of ``num_nodes``.

    Returns:
        ``(phy2log, log2phy, logcnt)``: ``phy2log`` ``[num_layers][num_replicas]`` the
        logical expert in each physical slot (slot ``p`` is on GPU
        ``p // (num_replicas // num_gpus)``); ``log2phy``
        ``[num_layers][num_logical_experts][max_replicas]`` the slots of each expert, in
        replica-rank order, padded with ``-1`` (``max_replicas`` is the largest replica count
        over all layers); ``logcnt`` ``[num_layers][num_logical_experts]`` replica counts.

    Raises:
        InputError: empty or ragged ``weight``; a negative, NaN or infinite load;
            ``num_replicas`` not a multiple of ``num_gpus``; ``num_gpus`` not a multiple of
            ``num_nodes``; ``num_replicas`` below the expert count; an expert count not
            divisible by ``num_groups``; a non-positive size. (Upstream only asserts the
            sizes the chosen policy needs; we check all of them in both policies.)
    """
    num_log = _check_matrix(weight)
    _check_shape(num_log, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, 1, 1, num_gpus
        )
    max_replicas = max(max(row) for row in logcnt)
    log2phy: list[list[list[int]]] = []
    for layer_phy2log, layer_rank in zip(phy2log, phyrank, strict=True):
        table = [[-1] * max_replicas for _ in range(num_log)]
        for p, (e, r) in enumerate(zip(layer_phy2log, layer_rank, strict=True)):
            table[e][r] = p
        log2phy.append(table)
    return phy2log, log2phy, logcnt
