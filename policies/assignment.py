"""Pure views of a plan the control plane hands out: a node's part (AgentService), an
engine's routing (EngineService), the difference of two versions (PlanService.DiffPlans),
and the imbalance of a committed plan under measured load (rebalancing).

No I/O; everything here is a function of plans, fleets and numbers.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from policies.errors import InputError
from policies.estimate.costmodel import build_cost_table
from policies.estimate.evaluation import LayerPlacement, evaluate
from policies.estimate.workload import Workload
from policies.exports.engine import export_plan, placement_document
from policies.hardware.fleet import Fleet
from policies.model.architecture import PRESETS, ModelSpec
from policies.plan import Plan
from policies.request import count_moves

ROUTING_FORMATS = ("sglang", "vllm", "trtllm", "native")


@dataclass(frozen=True)
class GpuPart:
    """One GPU of a node's part (mirrors ``mixfleet.v1.GpuAssignment``)."""

    gpu: str
    index: int
    uuid: str
    rank: int
    attention_share: float
    dp_weight: float
    expert_slots: int


@dataclass(frozen=True)
class NodePart:
    """A node's part of a plan.

    Attributes:
        gpus: the node's GPUs in the plan (rank order).
        document: the JSON object carried in ``Assignment.part_json`` (schema in agent.proto).
            It holds only this node's GPUs, so its size does not grow with the fleet.
        expert_location_zlib: engine form: the whole plan's SGLang ``--init-expert-location``
            document as zlib-compressed UTF-8 JSON (``Assignment.expert_location_zlib``), one
            bytes object shared by every node's part of the plan; empty in native form.
    """

    gpus: tuple[GpuPart, ...]
    document: dict[str, Any]
    expert_location_zlib: bytes = b""

    @cached_property
    def json(self) -> bytes:
        """``document`` as compact UTF-8 JSON, serialised once however often it is sent."""
        return json.dumps(self.document, separators=(",", ":")).encode()

    def to_json(self) -> bytes:
        return self.json


def _gpu_index(gpu_id: str) -> int:
    tail = gpu_id.rsplit("/", 1)[-1]
    digits = tail.removeprefix("gpu")
    return int(digits) if digits.isdigit() else -1


def expert_location(plan: Plan) -> dict[str, Any] | None:
    """SGLang ``--init-expert-location`` document of an engine-form MoE plan, else None."""
    if plan.form != "engine" or not plan.moe_layers or plan.slots_per_gpu is None:
        return None
    return placement_document(plan, "sglang")


def split_plan(
    plan: Plan,
    deployment: str,
    uuids: Mapping[str, str] | None = None,
    *,
    document: Mapping[str, Any] | None = None,
) -> dict[str, NodePart]:
    """Every node's part of ``plan`` (node name -> part), in plan node order.

    The whole-plan expert location is serialised and compressed once and shared by every
    part (it grows with the fleet, and every node needs all of it); each part's document
    names the JSON's digest (``expert_location_sha256``) so a node can check what it got.

    Args:
        uuids: GPU id -> hardware UUID from the nodes' inventories.
        document: ``plan.to_dict()`` when the caller has built it already (not modified).
    """
    uuids = uuids or {}
    doc_all = document if document is not None else plan.to_dict()
    docs = doc_all["gpus"]
    header = {k: v for k, v in doc_all.items() if k != "gpus"}
    location = expert_location(plan)
    location_zlib = b""
    location_ref: dict[str, Any] = {}
    if location is not None:
        location_json = json.dumps(location, separators=(",", ":")).encode()
        location_zlib = zlib.compress(location_json, 6)
        location_ref = {
            "expert_location_sha256": hashlib.sha256(location_json).hexdigest(),
            "expert_location_bytes": len(location_json),
        }
    gpus: dict[str, list[GpuPart]] = {}
    entries: dict[str, list[dict[str, Any]]] = {}
    for rank, g in enumerate(plan.gpus):
        gpus.setdefault(g.node, []).append(
            GpuPart(
                gpu=g.gpu,
                index=_gpu_index(g.gpu),
                uuid=uuids.get(g.gpu, ""),
                rank=rank,
                attention_share=g.attention_share,
                dp_weight=g.dp_weight,
                expert_slots=max((len(layer) for layer in g.experts), default=0),
            )
        )
        entries.setdefault(g.node, []).append({**docs[rank], "rank": rank})
    parts: dict[str, NodePart] = {}
    for node, node_gpus in gpus.items():
        doc: dict[str, Any] = {
            "deployment": deployment,
            "plan_id": plan.id,
            "version": plan.version,
            "node": node,
            "world_size": len(plan.gpus),
            "plan": header,
            "gpus": entries[node],
            **location_ref,
        }
        parts[node] = NodePart(tuple(node_gpus), doc, location_zlib)
    return parts


def engine_document(plan: Plan, fmt: str) -> dict[str, Any]:
    """The routing document of ``plan`` in an engine's format.

    Raises:
        InputError: unknown format, or an engine format asked of a native-form plan.
    """
    if fmt == "native":
        return plan.to_dict()
    if fmt not in ROUTING_FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose one of {ROUTING_FORMATS}", field="format")
    # A preset's model gives the family and MTP checks; a plan of an inline config is
    # exported with the structural checks alone.
    doc = export_plan(plan, fmt, PRESETS.get(plan.model))
    return {str(k) if isinstance(k, int) else k: v for k, v in doc.items()}


@dataclass(frozen=True)
class GpuChange:
    gpu: str
    attention_share_before: float
    attention_share_after: float
    experts_added: int
    experts_removed: int


@dataclass(frozen=True)
class PlanDiff:
    """What changed from plan ``a`` to plan ``b`` (see ``mixfleet.v1.PlanDiff``)."""

    expert_moves: int
    total_slots: int
    step_time_us_before: float
    step_time_us_after: float
    gpus_added: tuple[str, ...]
    gpus_removed: tuple[str, ...]
    gpus: tuple[GpuChange, ...]


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Expert moves and per-GPU changes from ``a`` to ``b``."""
    layers = [
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in b.gpus))
        for li in range(len(b.moe_layers))
    ]
    moves = (
        count_moves(a, [g.gpu for g in b.gpus], layers)
        if len(a.moe_layers) == len(b.moe_layers)
        else sum(len(layer) for g in b.gpus for layer in g.experts)
    )
    before = {g.gpu: g for g in a.gpus}
    after = {g.gpu: g for g in b.gpus}
    changes: list[GpuChange] = []
    for gid, gb in after.items():
        ga = before.get(gid)
        if ga is None:
            continue
        added = removed = 0
        for la, lb in zip(ga.experts, gb.experts, strict=False):
            ea = {s.expert for s in la}
            eb = {s.expert for s in lb}
            added += len(eb - ea)
            removed += len(ea - eb)
        if added or removed or abs(ga.attention_share - gb.attention_share) > 1e-9:
            changes.append(GpuChange(gid, ga.attention_share, gb.attention_share, added, removed))
    return PlanDiff(
        expert_moves=int(moves or 0),
        total_slots=sum(len(layer) for g in b.gpus for layer in g.experts),
        step_time_us_before=a.summary.step_time_us,
        step_time_us_after=b.summary.step_time_us,
        gpus_added=tuple(g for g in after if g not in before),
        gpus_removed=tuple(g for g in before if g not in after),
        gpus=tuple(changes),
    )


def aggregate_load(
    windows: Sequence[Sequence[Sequence[float]]], model: ModelSpec
) -> list[list[float]] | None:
    """Sum of load windows as ``[moe_layers][experts]``; windows of another shape are skipped.

    Rows may cover every layer (dense ones included) or only the MoE layers.
    """
    n_moe, n_exp = model.num_moe_layers, model.num_experts
    total = [[0.0] * n_exp for _ in range(n_moe)]
    used = 0
    for w in windows:
        rows = list(w)
        if len(rows) == model.num_layers and model.num_layers != n_moe:
            rows = [rows[i] for i in model.moe_layers]
        if len(rows) != n_moe or any(len(r) != n_exp for r in rows):
            continue
        for li, r in enumerate(rows):
            for e, v in enumerate(r):
                total[li][e] += float(v)
        used += 1
    return total if used else None


def imbalance_under_load(plan: Plan, fleet: Fleet, model: ModelSpec, workload: Workload) -> float:
    """Mean over MoE layers of (max - mean) / mean expert-phase time of ``plan`` when
    serving ``workload`` (the same measure as ``PlanSummary.imbalance``).

    ``fleet`` must list the plan's GPUs in plan order.

    Raises:
        InputError: the fleet does not match the plan's GPUs.
    """
    ids = [g.id for g in fleet.gpus]
    if ids != [g.gpu for g in plan.gpus]:
        raise InputError("the fleet's GPUs differ from the plan's", field="fleet")
    table = build_cost_table(fleet, model, workload)
    layers = [
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in plan.gpus))
        for li in range(len(plan.moe_layers))
    ]
    ev = evaluate(table, [g.attention_share for g in plan.gpus], layers)
    values: list[float] = []
    for t in ev.moe_layers:
        mean = sum(t.expert_us) / len(t.expert_us) if t.expert_us else 0.0
        values.append((max(t.expert_us) - mean) / mean if mean > 0 else 0.0)
    return sum(values) / len(values) if values else 0.0
