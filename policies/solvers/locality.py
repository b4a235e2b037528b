"""Replica positions for engines that pick the nearest replica (SGLang ``static``/``dynamic``).

Under SGLang's locality rule (:mod:`policies.estimate.engines`) the load of a replica is the tokens of
the ranks that pick it: its own GPU's, the tokens of its node's ranks without a replica when
it is the node's first, and a fair share of the ranks that find none nearby. So where the
replicas of an expert sit decides who uses them, and a placement balanced for even shares
can leave the first replica on a node with several times its planned share.

:func:`refine` is the last stage of the ``greedy`` and ``ilp`` policies for such engines: per
MoE layer, a local search swaps the experts of two slots on different GPUs while that lowers
the layer's dispatch+combine plus expert phases (each its slowest GPU) under the rule. The replica counts per expert and
the slots per GPU stay as the policy chose them. The search scores the seeded spread over
far replicas by its expectation (an even split); the plan is then scored with the exact rule
(:func:`policies.estimate.execution.executed`), and a layer keeps the policy's own positions when the
exact rule does not confirm the gain. The search is bounded by a number of swaps, not by the
clock, so the same inputs give the same plan on any machine.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from policies.estimate.costmodel import CostTable
from policies.estimate.engines import Runtime
from policies.estimate.evaluation import LayerPlacement
from policies.hardware.topology import Channel

MAX_SWAPS_PER_LAYER = 24
"""Upper bound on accepted swaps per layer (a work limit: the result is machine-independent)."""

_CANDIDATE_GPUS = 4
"""Least-loaded GPUs tried as the other side of a swap from the bottleneck GPU."""


def split(
    holders: Sequence[int], share: Sequence[float], node_of: Sequence[int], totals: Sequence[float]
) -> dict[int, float]:
    """Expected share of one expert's tokens each holder serves under the locality rule.

    Args:
        holders: GPUs (rank order) holding a replica, ascending, one entry per GPU.
        share: per rank, its share of the step's tokens.
        node_of: per rank, its node as the engine counts nodes.
        totals: per node, the sum of its ranks' shares.
    """
    if len(holders) == 1:
        return {holders[0]: 1.0}
    out = {g: share[g] for g in holders}  # each holder keeps its own tokens
    by_node: dict[int, list[int]] = {}
    for g in holders:
        by_node.setdefault(node_of[g], []).append(g)
    spread = 0.0  # tokens of ranks with no nearest replica: SGLang's fair spread
    for n, total in enumerate(totals):
        own = sum(share[g] for g in by_node.get(n, ()))
        rest = total - own
        members = by_node.get(n)
        if members and len(members) < len(holders):
            out[members[0]] += rest  # the node's first replica
        else:
            spread += rest
    for g in holders:
        out[g] += spread / len(holders)
    return out


class _Layer:
    """One layer's slots and the pairs each GPU serves under the rule."""

    def __init__(
        self,
        table: CostTable,
        li: int,
        placement: LayerPlacement,
        share: Sequence[float],
        node_of: Sequence[int],
    ) -> None:
        self.table, self.li = table, li
        self.share, self.node_of = share, node_of
        self.totals = [0.0] * (max(node_of) + 1)
        for g, x in enumerate(share):
            self.totals[node_of[g]] += x
        self.slots = [[e for e, _ in slots] for slots in placement.per_gpu]
        self.holders: dict[int, list[int]] = {}
        for g, experts in enumerate(self.slots):
            for e in experts:
                hs = self.holders.setdefault(e, [])
                if not hs or hs[-1] != g:
                    hs.append(g)
        self.pairs = [0.0] * len(self.slots)
        for e, hs in self.holders.items():
            for g, f in split(hs, share, node_of, self.totals).items():
                self.pairs[g] += table.pairs(li, e) * f
        self._comm_terms()

    def _comm_terms(self) -> None:
        """Per GPU the receive time per pair (us) of its slowest channel and its send time,
        which a swap barely changes (it moves pairs between receivers)."""
        t = self.table
        volume = t.total_tokens * t.top_k * t.bytes_per_copy
        a = np.asarray(self.share, dtype=float)
        total = t.total_tokens * t.top_k
        served = np.asarray(self.pairs, dtype=float) / total if total else a * 0
        self.recv_per_pair = [0.0] * len(self.slots)
        self.send_us = [0.0] * len(self.slots)
        for k, mask in enumerate(t.channel_masks):
            if k == Channel.LOCAL or mask.size == 0:
                continue
            recv = (mask @ a) * volume / t.comm_bw[:, k] / total
            send = a * (mask @ served) * volume / t.comm_bw[:, k]
            for g in range(len(self.slots)):
                self.recv_per_pair[g] = max(self.recv_per_pair[g], float(recv[g]))
                self.send_us[g] = max(self.send_us[g], float(send[g]))

    def cost(self, g: int, pairs: float) -> tuple[float, float]:
        """(dispatch+combine, expert phase) of GPU ``g`` serving ``pairs``, us."""
        t = self.table
        comm = max(self.send_us[g], self.recv_per_pair[g] * pairs) + float(t.comm_alpha[g])
        return comm, t.expert_us(g, pairs, len(self.slots[g]))

    def costs(self) -> list[tuple[float, float]]:
        return [self.cost(g, p) for g, p in enumerate(self.pairs)]

    def _delta(self, e: int, old: list[int], new: list[int], acc: dict[int, float]) -> None:
        w = self.table.pairs(self.li, e)
        for g, f in split(old, self.share, self.node_of, self.totals).items():
            acc[g] = acc.get(g, 0.0) - w * f
        for g, f in split(new, self.share, self.node_of, self.totals).items():
            acc[g] = acc.get(g, 0.0) + w * f

    def swap_effect(self, i: int, a: int, j: int, b: int) -> dict[int, float]:
        """Change of pairs per GPU when expert ``a`` on GPU ``i`` and ``b`` on ``j`` swap."""
        acc: dict[int, float] = {}
        ha, hb = self.holders[a], self.holders[b]
        self._delta(a, ha, sorted({*(g for g in ha if g != i), j}), acc)
        self._delta(b, hb, sorted({*(g for g in hb if g != j), i}), acc)
        return acc

    def apply(self, i: int, a: int, j: int, b: int, effect: dict[int, float]) -> None:
        self.slots[i][self.slots[i].index(a)] = b
        self.slots[j][self.slots[j].index(b)] = a
        self.holders[a] = sorted({*(g for g in self.holders[a] if g != i), j})
        self.holders[b] = sorted({*(g for g in self.holders[b] if g != j), i})
        for g, d in effect.items():
            self.pairs[g] += d

    def placement(self) -> LayerPlacement:
        """The slots, with even shares (the exact rule re-scores them)."""
        count: dict[int, int] = {}
        for experts in self.slots:
            for e in experts:
                count[e] = count.get(e, 0) + 1
        return LayerPlacement(
            tuple(tuple((e, 1.0 / count[e]) for e in experts) for experts in self.slots)
        )


def _objective(costs: Sequence[tuple[float, float]]) -> float:
    """The layer's dispatch+combine and expert phases, each its slowest GPU, us."""
    return max(c for c, _ in costs) + max(e for _, e in costs)


def _best_swap(
    layer: _Layer, costs: list[tuple[float, float]]
) -> tuple[int, int, int, int, dict[int, float]] | None:
    """The swap from the busiest GPU that lowers the layer's objective most, or None."""
    n = len(costs)
    top = _objective(costs)
    worst = max(range(n), key=lambda g: (layer.pairs[g], -g))
    others = sorted((g for g in range(n) if g != worst), key=lambda g: (layer.pairs[g], g))
    by_comm = sorted(range(n), key=lambda g: -costs[g][0])
    by_exp = sorted(range(n), key=lambda g: -costs[g][1])
    best: tuple[float, tuple[int, int, int, int, dict[int, float]]] | None = None
    mine = layer.slots[worst]
    for a in sorted(e for e in set(mine) if mine.count(e) == 1):
        for j in others[:_CANDIDATE_GPUS]:
            theirs = layer.slots[j]
            if a in theirs:
                continue
            for b in sorted(e for e in set(theirs) if theirs.count(e) == 1):
                if b in mine:
                    continue
                effect = layer.swap_effect(worst, a, j, b)
                new = {g: layer.cost(g, layer.pairs[g] + d) for g, d in effect.items()}
                comm = max(
                    max(c for c, _ in new.values()),
                    next((costs[g][0] for g in by_comm if g not in new), 0.0),
                )
                exp = max(
                    max(e for _, e in new.values()),
                    next((costs[g][1] for g in by_exp if g not in new), 0.0),
                )
                value = comm + exp
                if value < top - 1e-6 and (best is None or value < best[0] - 1e-9):
                    best = (value, (worst, a, j, b, effect))
    return best[1] if best else None


def refine(
    table: CostTable,
    runtime: Runtime,
    share: Sequence[float],
    layers: Sequence[LayerPlacement],
) -> list[LayerPlacement]:
    """Swap replicas within each layer to lower its expert phase under the locality rule.

    Args:
        table: cost table.
        runtime: the EP group's runtime (``gpus_per_node`` gives the engine's nodes).
        share: per rank, the token share its attention serves as executed.
        layers: the policy's engine-form layers.

    Returns:
        Layers with the same slots per GPU and replicas per expert, experts moved.
    """
    node_of = [g // max(1, runtime.gpus_per_node) for g in range(len(share))]
    out: list[LayerPlacement] = []
    for li, placement in enumerate(layers):
        layer = _Layer(table, li, placement, share, node_of)
        for _ in range(MAX_SWAPS_PER_LAYER):
            move = _best_swap(layer, layer.costs())
            if move is None:
                break
            layer.apply(*move)
        out.append(layer.placement())
    return out
