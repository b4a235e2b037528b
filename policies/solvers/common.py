"""Helpers shared by the policies: slot budgets, memory caps, engine-form layers."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence

from policies.estimate.costmodel import CostTable
from policies.estimate.evaluation import LayerPlacement


def slots_per_gpu(num_experts: int, redundant: int, num_gpus: int) -> int:
    """Engine-form slots on every GPU (the request check guarantees divisibility); 0 for a
    dense model."""
    return (num_experts + redundant) // num_gpus if num_experts else 0


def engine_layer(phy2log: Sequence[int], num_gpus: int) -> LayerPlacement:
    """Engine-form layer from a physical->logical row: slot p on GPU ``p // slots``, each
    replica serving ``1 / replicas`` of its expert's tokens."""
    slots = len(phy2log) // num_gpus
    count = Counter(phy2log)
    per_gpu = tuple(
        tuple((e, 1.0 / count[e]) for e in phy2log[g * slots : (g + 1) * slots])
        for g in range(num_gpus)
    )
    return LayerPlacement(per_gpu)


def free_expert_bytes(table: CostTable, i: int, attention_share: float) -> float:
    """Memory GPU i has left for routed experts (all MoE layers) at an attention share."""
    c = table.gpus[i]
    tokens = attention_share * table.total_tokens
    kv = table.kv_cache_bytes(i, tokens)
    return c.usable_bytes - c.fixed_bytes - kv - tokens * table.act_bytes_per_token


def slot_cap(table: CostTable, i: int, attention_share: float) -> int:
    """Most expert replicas GPU i can hold per MoE layer (memory split evenly over layers)."""
    if table.num_moe_layers == 0:
        return 0
    free = free_expert_bytes(table, i, attention_share)
    cap = math.floor(free / (table.num_moe_layers * table.expert_bytes) + 1e-9)
    return max(0, min(cap, table.num_experts))


def attention_speed_shares(table: CostTable) -> list[float]:
    """Attention shares proportional to each GPU's modelled attention speed (tokens per us
    at an equal share), then capped by KV memory with the excess handed to GPUs with room
    (water-filling)."""
    n = table.num_gpus
    even = table.total_tokens / n
    kind = "moe" if table.num_moe_layers else "dense"
    speed = [even / max(table.attention_us(i, even, kind), 1e-9) for i in range(n)]
    total = sum(speed)
    share = [s / total for s in speed]
    return cap_shares_by_memory(table, share, reserve_slots=[0] * n)


def max_share_for_memory(table: CostTable, i: int, reserve_bytes: float) -> float:
    """Largest attention share whose KV cache and activations fit GPU i next to
    ``reserve_bytes`` of expert weights."""
    c = table.gpus[i]
    room = c.usable_bytes - c.fixed_bytes - reserve_bytes
    if room <= 0:
        return 0.0
    k, shards = table.kv_split(i)  # a TP group keeps k x its KV, split ``shards`` ways
    per_token = table.act_bytes_per_token + k / shards * (
        table.context_len * table.kv_bytes_per_token if table.decode else table.kv_bytes_per_token
    )
    if not table.decode and table.context_len * table.kv_bytes_per_token / shards > room:
        return 0.0
    return min(1.0, room / per_token / table.total_tokens)


def cap_shares_by_memory(
    table: CostTable, share: Sequence[float], reserve_slots: Sequence[int]
) -> list[float]:
    """Clip shares to what fits and spread the excess over GPUs with room, in proportion
    to their current shares."""
    n = table.num_gpus
    caps = [
        max_share_for_memory(table, i, reserve_slots[i] * table.num_moe_layers * table.expert_bytes)
        for i in range(n)
    ]
    out = list(share)
    for _ in range(n + 1):
        excess = 0.0
        for i in range(n):
            if out[i] > caps[i]:
                excess += out[i] - caps[i]
                out[i] = caps[i]
        if excess <= 1e-12:
            break
        room = [i for i in range(n) if out[i] < caps[i] - 1e-12]
        if not room:
            break
        weight = sum(max(out[i], 1e-9) for i in room)
        for i in room:
            out[i] += excess * max(out[i], 1e-9) / weight
    total = sum(out)
    return [x / total for x in out] if total > 0 else [1.0 / n] * n


def make_room(
    held: list[list[tuple[int, float]]],
    has: list[set[int]],
    load: list[float],
    slots: Sequence[int],
    e: int,
) -> int:
    """Free a slot for expert ``e`` on a GPU that lacks it: move one of that GPU's replicas
    (one the receiving GPU lacks) to a GPU with a free slot. Engine form must fill every
    slot, and the GPUs with room may all hold ``e`` already. Returns the GPU that now has
    room for ``e``, or -1 when no such move exists."""
    free = [g for g in range(len(held)) if len(held[g]) < slots[g]]
    for g in free:
        for h, items in enumerate(held):
            if h == g or e in has[h]:
                continue
            for k, (e2, p2) in enumerate(items):
                if e2 not in has[g]:
                    items.pop(k)
                    has[h].discard(e2)
                    load[h] -= p2
                    held[g].append((e2, p2))
                    has[g].add(e2)
                    load[g] += p2
                    return h
    return -1


def replicate_capped(weight: Sequence[float], num_slots: int, max_replicas: int) -> list[int]:
    """EPLB's replication rule with a cap: one replica per expert, then each extra slot to
    the expert with the largest load per replica that has fewer than ``max_replicas``.

    Args:
        weight: load per logical expert (any unit).
        num_slots: physical slots to fill (>= number of experts).
        max_replicas: most replicas of one expert (the GPU count: two replicas of an
            expert on one GPU gain nothing).

    Returns:
        physical slot -> logical expert, experts in order then extra replicas in the order
        they were granted.
    """
    count = [1] * len(weight)
    phy = list(range(len(weight)))
    # max-heap on load per replica, lowest expert id first on ties (EPLB's argmax rule)
    heap = [(-float(w), e) for e, w in enumerate(weight) if max_replicas > 1]
    heapq.heapify(heap)
    for _ in range(num_slots - len(weight)):
        if not heap:
            break
        _, best = heapq.heappop(heap)
        count[best] += 1
        phy.append(best)
        if count[best] < max_replicas:
            heapq.heappush(heap, (-float(weight[best]) / count[best], best))
    return phy
