"""Where a token's pairs go: its top-k experts (:func:`route_logits`) and which replica of
each expert, by the engine's own rule.

The fast runtime (:mod:`agents.runtime.fast`) follows the rule of the engine it stands in
for (:mod:`policies.estimate.engines`): SGLang ``static`` (``sglang_static_map``: every rank sends an
expert's tokens to one replica, its nearest), ``even`` (vLLM's hash of the token index over
the replicas; TensorRT-LLM and SGLang without all-to-all split evenly too) or ``planned``
(the plan's shares, native form). :func:`replica_map` builds the choice once as plain lists,
:func:`device_map` moves it to the device and :func:`choose_physical` applies it to a
step's pairs without a host synchronisation.

Tensors are torch; torch is imported by this module (install ``mixfleet[gpu]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agents.runtime.routing import RankPlacement
from policies.estimate.engines import Runtime, parse_engine, resolve_runtime
from policies.estimate.replica_choice import sglang_static_map

Tensor = Any  # torch.Tensor; torch is untyped for mypy here

REPLICA_RULES = ("static", "even", "planned")
"""Replica choice: SGLang static nearest-replica, an even split, the plan's shares."""

VLLM_HASH = 2654435769  # vLLM's multiplier for the even replica choice


def engine_runtime(rule: str, world: int) -> Runtime:
    """The :class:`policies.estimate.engines.Runtime` whose replica rule is ``rule`` on one node of
    ``world`` GPUs (SGLang with DeepEP for ``static``, SGLang without all-to-all for
    ``even``, native for ``planned``)."""
    docs: dict[str, dict[str, Any]] = {
        "static": {"name": "sglang", "options": {"a2aBackend": "deepep", "dispatch": "static"}},
        "even": {"name": "sglang", "options": {"a2aBackend": "none"}},
        "planned": {"name": "native"},
    }
    doc = docs[rule]
    return resolve_runtime(parse_engine(doc), ["hopper"] * world, ["node"] * world)


@dataclass(frozen=True)
class ReplicaMap:
    """Every rank's replica choice, as plain lists (built once, then moved to the device).

    Attributes:
        rule: one of :data:`REPLICA_RULES`.
        slots_per_rank: local slots of each rank (physical slot p is rank ``p //
            slots_per_rank``'s slot ``p % slots_per_rank``).
        physical: ``[physical slot] -> expert`` over all ranks (SGLang's map row).
        static_pick: ``static`` only: ``[rank][expert] -> physical slot``.
        replicas: ``[expert] -> physical slots`` (ascending).
        shares: ``[physical slot] ->`` the plan's share of its expert's pairs.
    """

    rule: str
    slots_per_rank: int
    physical: tuple[int, ...]
    static_pick: tuple[tuple[int, ...], ...]
    replicas: tuple[tuple[int, ...], ...]
    shares: tuple[float, ...]


def replica_map(placement: RankPlacement, num_experts: int, rule: str) -> ReplicaMap:
    """The replica choice of ``placement`` under ``rule``.

    Raises:
        ValueError: unknown rule; ranks with unequal slot counts (engines need equal slots
            per rank); an expert without a replica.
    """
    if rule not in REPLICA_RULES:
        raise ValueError(f"replica rule {rule!r}: choose one of {', '.join(REPLICA_RULES)}")
    counts = {len(s) for s in placement.slots}
    if len(counts) != 1:
        raise ValueError(
            f"ranks hold {sorted(counts)} slots; engines need equal slots per rank. To fix: "
            "use the plan's engine form (equal slots per rank)"
        )
    slots = counts.pop()
    physical = tuple(e for rank in placement.slots for e, _ in rank)
    shares = tuple(s for rank in placement.slots for _, s in rank)
    reps: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(physical):
        reps[e].append(p)
    missing = [e for e, r in enumerate(reps) if not r]
    if missing:
        raise ValueError(f"experts {missing[:8]} have no replica in the placement")
    pick: tuple[tuple[int, ...], ...] = ()
    if rule == "static":
        world = placement.world
        table = sglang_static_map([list(physical)], num_experts, world, world)
        pick = tuple(tuple(table[r][0]) for r in range(world))
    return ReplicaMap(rule, slots, physical, pick, tuple(tuple(r) for r in reps), shares)


@dataclass
class DeviceMap:
    """:class:`ReplicaMap` on the device, for this rank."""

    static_pick: Tensor  # [E] physical slot (static)
    rep_phys: Tensor  # [E, R] physical slots, padded with the last
    rep_count: Tensor  # [E]
    rep_cum: Tensor  # [E, R] cumulative shares, padding 2.0


def device_map(m: ReplicaMap, rank: int, device: Any) -> DeviceMap:
    """``m`` as tensors on ``device`` for rank ``rank`` (replicas padded to the widest)."""
    width = max(len(r) for r in m.replicas)
    phys = [[r[min(j, len(r) - 1)] for j in range(width)] for r in m.replicas]
    cum = []
    for r in m.replicas:
        total = sum(m.shares[p] for p in r) or 1.0
        acc, row = 0.0, []
        for j in range(width):
            acc += m.shares[r[j]] / total if j < len(r) else 0.0
            row.append(2.0 if j >= len(r) - 1 else acc)
        cum.append(row)
    pick = m.static_pick[rank] if m.static_pick else [r[0] for r in m.replicas]
    return DeviceMap(
        torch.tensor(pick, dtype=torch.int64, device=device),
        torch.tensor(phys, dtype=torch.int64, device=device),
        torch.tensor([len(r) for r in m.replicas], dtype=torch.int64, device=device),
        torch.tensor(cum, dtype=torch.float32, device=device),
    )


def choose_physical(idx: Tensor, m: DeviceMap, rule: str) -> Tensor:
    """Physical slot of every pair (``idx`` ``[T, top_k]`` experts, token-major).

    ``even``: replica ``(t * 2654435769 mod 2**32) mod n`` of the n replicas (vLLM, t the
    token's index in the batch); ``planned``: the replica whose cumulative share first
    exceeds a per-pair hash fraction (the plan's shares in expectation)."""
    if rule == "static":
        return m.static_pick[idx].reshape(-1)
    t, k = idx.shape
    e = idx.reshape(-1)
    tok = torch.arange(t, device=idx.device, dtype=torch.int64).repeat_interleave(k)
    if rule == "even":
        j = ((tok * VLLM_HASH) & 0xFFFFFFFF) % m.rep_count[e]
    else:
        pair = torch.arange(t * k, device=idx.device, dtype=torch.int64)
        u = (((pair * VLLM_HASH) & 0xFFFFFFFF).float() + 0.5) / 2.0**32
        j = (u[:, None] >= m.rep_cum[e]).sum(1).clamp_(max=m.rep_cum.shape[1] - 1)
    return m.rep_phys[e, j]


def route_logits(logits: Tensor, top_k: int, sample_logits: Tensor | None) -> Any:
    """Top-k experts per token and their weights from float32 router ``logits``
    (:func:`agents.runtime.layer.route` after its GEMM: ``sample_logits`` draws the choice
    by Gumbel-top-k from a load profile, the logits still weight the outputs)."""
    if sample_logits is None:
        top, idx = torch.topk(logits, top_k, dim=-1)
    else:
        u = torch.rand(logits.shape, device=logits.device).clamp_(1e-9, 1.0 - 1e-9)
        idx = torch.topk(sample_logits[None, :] - torch.log(-torch.log(u)), top_k, -1).indices
        top = torch.gather(logits, 1, idx)
    return idx, torch.softmax(top, dim=-1)
