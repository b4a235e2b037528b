"""Replica choice: which replica of an expert each DP rank's tokens go to, under the rule
of the group's runtime (:class:`policies.estimate.engines.Runtime`; the rules, each from the
engine's own source, are in the docstring of :mod:`policies.estimate.engines`).

:func:`sglang_static_map` replays SGLang's seeded static choice exactly;
:func:`dispatch` gives, per layer, the share of each expert's tokens every replica serves
and, with the experts' loads, the traffic between ranks.

Pure: no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from policies.estimate.engines import Runtime

Traffic = npt.NDArray[np.float64]
"""One layer's traffic matrix ``[src rank][dst rank]``: the fraction of the layer's
token-expert pairs src's tokens send to dst."""

SGLANG_DISPATCH_SEED = 42
"""Seed of SGLang's ``compute_logical_to_rank_dispatch_physical_map`` (its default)."""


def _nearest(candidates: Sequence[int], rank: int, slots_per_rank: int, gpus_per_node: int) -> int:
    """SGLang ``_find_nearest_expert``: the only candidate; else the first on the rank's
    GPU; else the first on its node when that narrows the candidates; else -1."""
    if len(candidates) == 1:
        return candidates[0]
    for p in candidates:
        if p // slots_per_rank == rank:
            return p
    node = rank // gpus_per_node
    per_node = slots_per_rank * gpus_per_node
    same = [p for p in candidates if p // per_node == node]
    if 0 < len(same) < len(candidates):
        return same[0]
    return -1


def _fair_choices(arr: Sequence[int], k: int, r: random.Random) -> list[int]:
    """SGLang ``_fair_choices``: ``k`` picks, each candidate ``k // len`` times, the
    remainder sampled, then shuffled (the same calls on the same generator)."""
    quotient, remainder = divmod(k, len(arr))
    ans = list(arr) * quotient + r.sample(list(arr), k=remainder)
    r.shuffle(ans)
    return ans


def replicas_of(row: Sequence[int], num_logical: int) -> list[list[int]]:
    """Physical slots of each logical expert, ascending (``logical_to_all_physical``)."""
    out: list[list[int]] = [[] for _ in range(num_logical)]
    for p, e in enumerate(row):
        out[e].append(p)
    return out


def sglang_static_map(
    rows: Sequence[Sequence[int]],
    num_logical: int,
    ep_size: int,
    gpus_per_node: int,
    seed: int = SGLANG_DISPATCH_SEED,
) -> list[list[list[int]]]:
    """``[rank][layer][logical expert] ->`` the physical slot that rank sends the expert's
    tokens to, exactly as SGLang 0.5.23 computes it with an all-to-all backend and
    ``static`` dispatch.

    ``rows`` is the whole ``--init-expert-location`` map (every decoder layer, dense rows
    included: their draws advance the seeded generator too). Each rank computes its own
    row: SGLang first collapses every expert's candidates to that rank's nearest replica
    (``_compute_logical_to_all_physical_map``), then runs
    ``compute_logical_to_rank_dispatch_physical_map`` on the collapsed candidates with a
    fresh ``random.Random(seed)`` and keeps its own row. An expert that collapsed draws
    nothing; one that did not draws ``_fair_choices`` over all its replicas for every rank
    without a nearest one, and the rank takes its position among them.
    """
    slots = len(rows[0]) // ep_size
    # Per (layer, expert): candidates, each rank's nearest, the position of each rank
    # without one among those ranks.
    table: list[list[tuple[list[int], list[int], dict[int, int]]]] = []
    for row in rows:
        per_expert = []
        for cands in replicas_of(row, num_logical):
            near = [_nearest(cands, q, slots, gpus_per_node) for q in range(ep_size)]
            without = [q for q in range(ep_size) if near[q] == -1]
            per_expert.append((cands, near, {q: i for i, q in enumerate(without)}))
        table.append(per_expert)
    # A rank's draws depend only on which experts collapse for it: ranks alike in that
    # (usually the GPUs of one node) make the same calls on the generator, so one replay
    # serves them all, each taking its own position among the ranks without a nearest.
    alike: dict[bytes, list[int]] = {}
    for rank in range(ep_size):
        key = bytes(near[rank] == -1 for per_expert in table for _, near, _ in per_expert)
        alike.setdefault(key, []).append(rank)
    out: list[list[list[int]]] = [[] for _ in range(ep_size)]
    for ranks in alike.values():
        r = random.Random(seed)
        first = ranks[0]
        for per_expert in table:
            picks: dict[int, list[int]] = {q: [] for q in ranks}
            for cands, near, position in per_expert:
                if near[first] != -1:
                    for q in ranks:
                        picks[q].append(near[q])
                    continue
                choices = _fair_choices(cands, len(position), r)
                for q in ranks:
                    picks[q].append(choices[position[q]])
            for q in ranks:
                out[q].append(picks[q])
    return out


def served_shares(
    runtime: Runtime,
    rows: Sequence[Sequence[int]],
    num_logical: int,
    rank_share: Sequence[float],
    planned: Sequence[Sequence[float]] | None = None,
) -> list[list[float]]:
    """Per layer and physical slot, the share of its expert's tokens the slot serves under
    the runtime's replica rule (:func:`dispatch` without the traffic)."""
    return dispatch(runtime, rows, num_logical, rank_share, planned=planned)[0]


def dispatch(
    runtime: Runtime,
    rows: Sequence[Sequence[int]],
    num_logical: int,
    rank_share: Sequence[float],
    *,
    planned: Sequence[Sequence[float]] | None = None,
    weights: Sequence[Sequence[float]] | None = None,
) -> tuple[list[list[float]], list[Traffic] | None]:
    """Where each rank's tokens of each expert go under the runtime's replica rule.

    Args:
        runtime: the group's runtime.
        rows: ``[layer][physical slot] -> logical expert`` (for SGLang static: every
            decoder layer, as exported).
        num_logical: logical experts per layer.
        rank_share: per rank, the share of the step's tokens its attention serves.
        planned: ``planned`` rule only: the plan's shares per layer and slot.
        weights: per layer, each expert's fraction of the layer's token-expert pairs; when
            given (and the rule is locality-based) the traffic matrices are computed too.

    Returns:
        (per layer and slot the share of its expert's tokens it serves; for ``static`` and
        ``dynamic`` with ``weights``, per layer ``traffic[src rank][dst rank]``, the fraction
        of the layer's pairs src's tokens send to dst, else None).
    """
    ep = len(rank_share)
    slots = len(rows[0]) // ep if rows else 0
    total = sum(rank_share) or 1.0
    x = [s / total for s in rank_share]
    local = runtime.dispatch in ("static", "dynamic")
    static = (
        sglang_static_map(rows, num_logical, ep, runtime.gpus_per_node)
        if runtime.dispatch == "static"
        else None
    )
    shares: list[list[float]] = []
    traffic: list[Traffic] | None = [] if (local and weights is not None) else None
    for li, row in enumerate(rows):
        if runtime.dispatch == "dynamic":
            w_row = weights[li] if weights is not None else None
            share, dyn_flows = _dynamic_layer(
                row, num_logical, x, slots, runtime.gpus_per_node, w_row
            )
            shares.append(share)
            if traffic is not None and dyn_flows is not None:
                traffic.append(dyn_flows)
            continue
        share = [0.0] * len(row)
        flows = [[0.0] * ep for _ in range(ep)] if traffic is not None else None
        for e, cands in enumerate(replicas_of(row, num_logical)):
            if not cands:
                continue
            if runtime.dispatch == "planned":
                assert planned is not None, "planned shares are needed for native form"
                for p in cands:
                    share[p] = planned[li][p]
                continue
            if runtime.dispatch == "even":
                for p in cands:
                    share[p] = 1.0 / len(cands)
                continue
            w = weights[li][e] if weights is not None else 0.0
            for q in range(ep):
                assert static is not None  # dynamic: _dynamic_layer
                p = static[q][li][e]
                share[p] += x[q]
                if flows is not None:
                    flows[q][p // slots] += x[q] * w
        shares.append(share)
        if traffic is not None and flows is not None:
            traffic.append(np.asarray(flows, dtype=float))
    return shares, traffic


def _dynamic_layer(
    row: Sequence[int],
    num_logical: int,
    x: Sequence[float],
    slots: int,
    gpus_per_node: int,
    weights: Sequence[float] | None,
) -> tuple[list[float], Traffic | None]:
    """One layer of :func:`dispatch` under the ``dynamic`` rule: each rank sends an expert's
    tokens to its nearest replica (:func:`_nearest`), else spreads them evenly over all
    replicas (the expectation of a uniform pick; also that of SGLang's ``static`` choice).

    Only the ranks on a node that holds a replica can have a nearest one, so they are
    treated one by one and every other rank in aggregate: the work per expert grows with
    its replicas, not with the ranks. With ``weights`` (the layer's expert fractions) the
    traffic matrix ``[src rank][dst rank]`` is returned too, else None: every rank's
    default spread (one outer product) plus the corrections of the ranks with a nearest.
    """
    ep = len(x)
    per_node = slots * gpus_per_node
    everyone = sum(x)
    share = [0.0] * len(row)
    moved: dict[tuple[int, int], float] = {}  # (src, dst) -> correction to the spread
    spread = [0.0] * ep  # per destination rank: the pairs every rank sends there by default
    for e, cands in enumerate(replicas_of(row, num_logical)):
        if not cands:
            continue
        w = weights[e] if weights is not None else 0.0
        if len(cands) == 1:  # every rank's nearest is the only replica
            share[cands[0]] += everyone
            spread[cands[0] // slots] += w
            continue
        near: dict[int, int] = {}  # rank -> its nearest replica (ascending: the first wins)
        for p in cands:
            near.setdefault(p // slots, p)
        nodes: dict[int, list[int]] = {}
        for p in cands:
            nodes.setdefault(p // per_node, []).append(p)
        for node, same in nodes.items():
            if len(same) < len(cands):
                for q in range(node * gpus_per_node, min(ep, (node + 1) * gpus_per_node)):
                    near.setdefault(q, same[0])
        f = 1.0 / len(cands)
        rest = everyone - sum(x[q] for q in near)
        for p in cands:
            share[p] += rest * f
            spread[p // slots] += w * f
        for q, p in near.items():
            share[p] += x[q]
            if weights is not None:
                for c in cands:  # q does not spread: take back its default share
                    key = (q, c // slots)
                    moved[key] = moved.get(key, 0.0) - x[q] * w * f
                key = (q, p // slots)
                moved[key] = moved.get(key, 0.0) + x[q] * w
    if weights is None:
        return share, None
    flows = np.outer(np.asarray(x, dtype=float), np.asarray(spread, dtype=float))
    for (q, dst), v in moved.items():
        flows[q, dst] += v
    return share, flows
