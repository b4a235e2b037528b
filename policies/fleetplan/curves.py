"""Per-variant step curves: one engine instance's decode-step and prefill times, computed once
per node make-up from the one cost model and reused for every batch size.

A curve (:class:`policies.serving.curves.StepCurve`) is filled by solving the instance ONCE
with a fast policy (``eplb`` for MoE models: the engine's own layout, no SGLang locality
search and no per-layer ILP), replaying the engine's dispatch of that placement once
(:func:`policies.estimate.execution.executed`), and then re-scoring the same placement with the cost
model (:func:`policies.estimate.evaluation.evaluate`) at every grid point: a batch x context grid of
decode steps and a token grid of prefill forwards. Step times between grid points are
interpolated by the curve; the placement (and so the attention TP sizes and the replica
layout) stays the one of the reference solve, as a running engine's would.

KV capacity comes from the same evaluation: each GPU's usable memory less its weights,
experts and activations, divided by the KV bytes its share of the batch takes per context
token; the instance holds the smallest of those (the first GPU to fill stops admission).

:func:`curve_key` is a stable hash of everything that changes a curve (model, node make-up,
engine, dtypes, load, form, grids, :data:`CURVE_VERSION` and the cost model's
:data:`~policies.estimate.costmodel.COST_MODEL_VERSION`); :class:`CurveCache` is the
load/store interface a caller backs with disk (``apis.curvecache``), and
:class:`MemoryCurveCache` keeps them in a dict.

Units: microseconds (``_us``), tokens, bytes. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

from policies.deployment import node_make_up
from policies.errors import InfeasibleError, InputError
from policies.estimate.costmodel import COST_MODEL_VERSION, CostSettings, CostTable
from policies.estimate.engines import engine_to_doc
from policies.estimate.evaluation import LayerPlacement, evaluate
from policies.estimate.execution import executed, runtime_of
from policies.estimate.tensor_parallel import tp_cost_table
from policies.hardware.fleet import Fleet
from policies.request import PlacementRequest, PolicyName, RawPlacement, check_request
from policies.serving.curves import StepCurve
from policies.solve import PLACE, fits_at_all, solve
from policies.spec.build import DeploymentSpec, SolverPolicy, to_request, workload_for

CURVE_VERSION = "fleetplan-curve-3"
"""Bumped whenever the curve's document format or the way a curve is filled changes: a cached
curve of another version is never read. A change of the cost model's formulas bumps
:data:`policies.estimate.costmodel.COST_MODEL_VERSION` instead, which the key also holds (as it holds
the cost model's default settings and efficiencies)."""


@dataclass(frozen=True)
class CurveGrid:
    """Where a curve is sampled.

    Attributes:
        batch_per_gpu: decode sequences per GPU (the instance's batch is this times its GPUs);
            dense at small batches, where the step grows fastest (the experts read grows
            with the experts that get tokens).
        context_tokens: mean context per sequence in a decode step, tokens. Two points
            suffice: per GPU the step is linear in the context (the KV read and the score
            FLOPs grow with it); the maximum over GPUs makes it convex, so between the
            points the curve errs high, and beyond the last it continues the last slope.
        prefill_per_gpu: prompt tokens per GPU in one prefill forward.
        reference_batch_per_gpu: batch per GPU of the one placement solve, sequences.
        reference_context_tokens: context of the placement solve, tokens.
        estimate_policy: policy of the placement solve (``eplb``: the engine's own layout;
            ``uniform``; ``greedy``).
    """

    batch_per_gpu: tuple[int, ...] = (1, 4, 16, 48, 128, 256)
    context_tokens: tuple[int, ...] = (1024, 8192)
    prefill_per_gpu: tuple[int, ...] = (64, 512, 2048, 8192)
    reference_batch_per_gpu: int = 16
    reference_context_tokens: int = 2048
    estimate_policy: str = "eplb"


@dataclass(frozen=True)
class CurveEntry:
    """A computed curve of one make-up, or why the make-up cannot run the model.

    Attributes:
        curve: the step curve (None when the model does not fit or the engine refuses).
        gpus: GPUs of the instance.
        attention_tp: attention TP size per GPU of the reference placement, fleet order.
        reason: why there is no curve ("" when there is one).
    """

    curve: StepCurve | None
    gpus: int
    attention_tp: tuple[int, ...] = ()
    reason: str = ""

    def to_doc(self) -> dict[str, Any]:
        """The JSON document (inverse of :meth:`from_doc`)."""
        doc: dict[str, Any] = {
            "version": CURVE_VERSION,
            "gpus": self.gpus,
            "attentionTp": list(self.attention_tp),
            "reason": self.reason,
        }
        if self.curve is not None:
            doc["curve"] = self.curve.to_doc()
        return doc

    @staticmethod
    def from_doc(doc: Any, path: str = "entry") -> CurveEntry:
        """A cached entry of its document.

        Raises:
            InputError: not an entry of this :data:`CURVE_VERSION` (the field is named).
        """
        if not isinstance(doc, Mapping):
            raise InputError("must be a mapping", field=path)
        if doc.get("version") != CURVE_VERSION:
            raise InputError(
                f"curve version {doc.get('version')!r}, this mixfleet reads {CURVE_VERSION}",
                field=f"{path}.version",
            )
        gpus = doc.get("gpus")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise InputError(f"must be a whole number >= 1, got {gpus!r}", field=f"{path}.gpus")
        tp = doc.get("attentionTp", [])
        if not isinstance(tp, list) or not all(isinstance(k, int) for k in tp):
            raise InputError("must be a list of whole numbers", field=f"{path}.attentionTp")
        curve = doc.get("curve")
        return CurveEntry(
            curve=StepCurve.from_doc(curve, f"{path}.curve") if curve is not None else None,
            gpus=gpus,
            attention_tp=tuple(tp),
            reason=str(doc.get("reason", "")),
        )


class CurveCache(Protocol):
    """Where computed curves are kept between runs (keyed by :func:`curve_key`)."""

    def get(self, key: str) -> CurveEntry | None:
        """The entry of ``key``, or None when it is not kept."""

    def put(self, key: str, entry: CurveEntry) -> None:
        """Keep ``entry`` under ``key``."""


@dataclass
class MemoryCurveCache:
    """Curves kept in memory (the default; mutable, the caller owns it).

    Attributes:
        entries: key -> entry.
        computed: curves computed through this cache (not found in it).
    """

    entries: dict[str, CurveEntry] = field(default_factory=dict)
    computed: int = 0

    def get(self, key: str) -> CurveEntry | None:
        return self.entries.get(key)

    def put(self, key: str, entry: CurveEntry) -> None:
        self.computed += 1
        self.entries[key] = entry


def curve_spec(spec: DeploymentSpec, grid: CurveGrid) -> DeploymentSpec:
    """The spec a curve is computed with: ``spec``'s model, engine, form and dtypes at the
    grid's reference batch and context and its estimate policy (scheduling, traffic and
    naming fields do not change a curve)."""
    w = replace(
        spec.workload,
        phase="decode",
        tokens_per_gpu=grid.reference_batch_per_gpu,
        context_len=grid.reference_context_tokens,
    )
    return replace(spec, workload=w, policy=grid.estimate_policy)


def curve_key(spec: DeploymentSpec, part: Fleet, grid: CurveGrid) -> str:
    """A stable hash (hex) of everything that changes the curve of ``spec`` on ``part``:
    model (preset name or config), form, redundant experts, cross-vendor flag, engine, KV
    dtype, expert load, the nodes' make-ups and counts (not their names), the fabric links
    between them, the grid, :data:`CURVE_VERSION`, the cost model's default settings and
    :data:`~policies.estimate.costmodel.COST_MODEL_VERSION` (so a curve cached on disk is never reused
    after a cost formula changes)."""
    w = spec.workload
    makeups = sorted(repr(node_make_up(n)) for n in part.nodes)
    links = sorted(
        repr((x.a, x.b, x.per_direction_gbits_per_s, x.latency_us)) for x in part.fabric_links
    )
    doc = {
        "version": CURVE_VERSION,
        "costModelVersion": COST_MODEL_VERSION,
        "model": spec.model,
        "modelConfig": json.dumps(spec.model_config, sort_keys=True, default=repr),
        "form": spec.form,
        "redundantExperts": spec.redundant_experts,
        "crossVendor": spec.allow_cross_vendor,
        "engine": engine_to_doc(spec.engine),
        "kvCacheDtype": w.kv_cache_dtype,
        "load": w.load,
        "loadMatrix": [list(r) for r in w.load_matrix] if w.load_matrix is not None else None,
        "makeups": makeups,
        "links": links,
        "grid": repr(grid),
        "costSettings": repr(CostSettings()),
    }
    text = json.dumps(doc, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def compute_curve(spec: DeploymentSpec, part: Fleet, grid: CurveGrid = CurveGrid()) -> CurveEntry:
    """The step curve of one instance of ``spec`` on every GPU of ``part``.

    One placement solve (``grid.estimate_policy``) and one dispatch replay, then one cost-model
    evaluation per grid point. A make-up that cannot hold the model, or that the engine
    refuses, gives an entry without a curve and with the reason.

    Raises:
        InputError: an invalid spec (the field is named).
    """
    n = len(part.gpus)
    ref = curve_spec(spec, grid)
    try:
        req = to_request(ref, SolverPolicy(workers=1), part)
        check_request(req)
        runtime = runtime_of(req)
        placed = _place(req, runtime.exchange_in(req.workload.decode))
    except InfeasibleError as exc:
        return CurveEntry(None, n, reason=str(exc) or "infeasible")
    except InputError as exc:
        if exc.field in ("engine", "form", "fleet") or (exc.field or "").startswith("nodes"):
            return CurveEntry(None, n, reason=str(exc))
        raise
    if isinstance(placed, str):
        return CurveEntry(None, n, reason=placed)
    raw, tp, ref_table = placed
    run = executed(req, runtime, raw, ref_table)
    capacity = _kv_capacity_tokens(run, ref_table)
    if capacity < 1:
        return CurveEntry(
            None,
            n,
            tp,
            reason="no memory is left for the KV cache after weights and experts. To fix: "
            "use more or larger GPUs for this model",
        )

    def step_us(phase: str, per_gpu: int, context: int) -> float:
        w = replace(spec.workload, phase=phase, tokens_per_gpu=per_gpu, context_len=context)
        workload = workload_for(replace(spec, workload=w), req.model, measured=None)
        table = replace(
            tp_cost_table(part, req.model, workload, req.settings, tp),
            exchange=runtime.exchange_in(phase == "decode"),
        )
        return evaluate(table, run.attention_share, run.layers, table.exchange).step_time_us

    decode = tuple(
        tuple(step_us("decode", b, c) for c in grid.context_tokens) for b in grid.batch_per_gpu
    )
    prefill = tuple(
        step_us("prefill", t, min(max(t, 512), grid.context_tokens[-1]))
        for t in grid.prefill_per_gpu
    )
    kvb = ref_table.kv_bytes_per_token
    curve = StepCurve(
        batch_grid=tuple(b * n for b in grid.batch_per_gpu),
        context_grid=grid.context_tokens,
        decode_step_us=decode,
        prefill_grid=tuple(t * n for t in grid.prefill_per_gpu),
        prefill_us=prefill,
        max_batch=max(1, capacity // grid.context_tokens[-1]),
        kv_bytes_per_token=kvb,
        kv_capacity_tokens=capacity,
    )
    return CurveEntry(curve, n, tp)


def _place(
    req: PlacementRequest, exchange: str
) -> tuple[RawPlacement, tuple[int, ...], CostTable] | str:
    """The reference placement: ``(raw placement, attention TP per GPU, its cost table)``,
    or why none exists. Data-parallel attention (TP 1 on every GPU) when the model fits so,
    placed directly by the request's policy; else the full front door
    (:func:`policies.solve.solve`, which also tries tensor-parallel attention groups)."""
    n = len(req.fleet.gpus)
    tp: tuple[int, ...] = (1,) * n
    table = replace(
        tp_cost_table(req.fleet, req.model, req.workload, req.settings, tp), exchange=exchange
    )
    if fits_at_all(req, table) is None:
        answer = PLACE[cast(PolicyName, req.policy)](req, table)
        if isinstance(answer, RawPlacement):
            return answer, tp, table
    result = solve(req)
    if not result.placed:
        return result.message or "the model does not fit"
    plan = result.plan
    tp = tuple(g.attention_tp for g in plan.gpus)
    raw = RawPlacement(
        tuple(g.dp_weight / n for g in plan.gpus),
        tuple(
            LayerPlacement(
                tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in plan.gpus)
            )
            for li in range(len(plan.moe_layers))
        ),
    )
    table = replace(
        tp_cost_table(req.fleet, req.model, req.workload, req.settings, tp), exchange=exchange
    )
    return raw, tp, table


def _kv_capacity_tokens(run: RawPlacement, table: CostTable) -> int:
    """KV tokens (sequences x context) the instance holds: per GPU, usable memory less
    weights, experts and activations at the reference batch, over the KV bytes its share of
    one context token of the batch takes; the smallest over the GPUs."""
    ev = evaluate(table, run.attention_share, run.layers, table.exchange)
    batch_tokens = table.total_tokens * table.context_len  # sequences x context at reference
    best = math.inf
    for mem in ev.memory_bytes:
        kv = mem.get("kv_cache", 0.0)
        if kv <= 0:
            continue
        free = mem["usable"] - (mem["total"] - kv)
        best = min(best, free / (kv / batch_tokens))
    if not math.isfinite(best):
        return 0
    return max(0, int(best))
