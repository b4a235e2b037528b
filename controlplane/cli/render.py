"""``mixfleetctl plan render``: a picture to debug a plan with.

What the picture answers (panels computed in :mod:`controlplane.cli.plan_panels`, drawn by
:mod:`controlplane.cli.plan_figure`):

1. **What sets the step time**: one bar splitting the predicted step into its phases
   (attention of dense and MoE layers, dispatch+combine, expert compute; each phase of a
   layer costs its slowest GPU), each labelled with the GPU that is slowest most often.
2. **Which experts and hot replicas sit where** in one MoE layer (``--layer``; default the
   layer that takes longest): GPUs x the hottest experts (every replicated expert first),
   coloured by the token-expert pairs each replica serves.
3. **Expert-phase time per GPU and MoE layer**, the slowest GPU of each layer marked.
4. **Per-GPU time per phase** over the step, **memory headroom** per GPU (weights, experts,
   KV cache, activations against usable memory, from the plan) and the attention share.
5. **Communication per link**: dispatch+combine bytes per step between every pair of nodes,
   with the channel they use (NVLink inside a node, RDMA, a fabric link).

GPU types keep one colour in every picture (:func:`type_colours`).

A plan stores the placement, memory and shares but not the expert load or per-layer times,
so those are rebuilt from the plan's own inputs: the model (the plan's preset, or the model
given), the load (``uniform`` and ``synthetic:zipf:...`` are regenerated; a load file must
be given again) and the GPUs (the fleet given, else catalog figures). The engine's replica
choice (SGLang's static nearest-replica dispatch) is replayed from the plan's engine record.
Without the fleet, link times are unknown and the dispatch+combine phase is left out (the
picture says so); without the load, panel 2 shows replica shares and panel 3 replica slots.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.cli.plan_panels import (
    ExpertView,
    Grid,
    LinkTraffic,
    PhaseSlice,
    busy,
    executed_layers,
    expert_view,
    links,
    phases,
    runtime_of_plan,
)
from policies.errors import InputError
from policies.estimate.costmodel import CostTable, build_cost_table
from policies.estimate.evaluation import LayerPlacement, evaluate, served_fractions
from policies.estimate.tensor_parallel import tp_cost_table
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.hardware.catalog import lookup
from policies.hardware.fleet import Fleet, Gpu, GpuId, Node
from policies.model.architecture import ModelSpec, preset
from policies.plan import Plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Colours of the catalog's GPU models, fixed so a type looks the same in every picture.
_TYPE_COLOURS = {
    "A100-SXM4-80GB": "#1f77b4",
    "A100-SXM4-40GB": "#6baed6",
    "H100-SXM5-80GB": "#d62728",
    "H100-PCIe": "#ff9896",
    "H800-SXM5": "#e377c2",
    "H200-SXM-141GB": "#2ca02c",
    "B200": "#9467bd",
    "L40S": "#ff7f0e",
    "L4": "#bcbd22",
    "V100-SXM2-32GB": "#8c564b",
    "V100-SXM2-16GB": "#c49c94",
    "MI300X": "#17becf",
}
#: Colours for GPU models outside the table, picked by a hash of the name.
_SPARE_COLOURS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d")


@dataclass(frozen=True)
class PlanPicture:
    """The numbers a plan picture shows (rows: GPUs in plan order; columns: MoE layers).

    Attributes:
        gpu_labels: GPU ids.
        gpu_models: GPU catalog model per GPU.
        layer_labels: model layer index of each MoE layer.
        load: per GPU per MoE layer, the value of ``load_title``.
        load_title: what ``load`` holds and its unit.
        time: per GPU per MoE layer, the value of panel 3 (see ``time_title``).
        time_title: what ``time`` holds and its unit.
        attention_share: per GPU, fraction of the step's tokens (sums to 1).
        title: headline (fleet, model, policy, step time, throughput).
        phases: the step split by phase (empty when model or load is unknown).
        step_us: the step the phases add up to, recomputed from the inputs, us.
        busy_us: per GPU ``(attention, dispatch+combine, experts)`` over the step, us.
        memory_bytes: per GPU ``(weights, experts, kv_cache, activations, usable)``.
        experts: the placement panel (None for dense models).
        links: the communication panel (None when it cannot be computed).
        notes: caveats shown under the title.
    """

    gpu_labels: tuple[str, ...]
    gpu_models: tuple[str, ...]
    layer_labels: tuple[int, ...]
    load: Grid
    load_title: str
    time: Grid
    time_title: str
    attention_share: tuple[float, ...]
    title: str
    phases: tuple[PhaseSlice, ...] = ()
    step_us: float = 0.0
    busy_us: Grid = ()
    memory_bytes: Grid = ()
    experts: ExpertView | None = None
    links: LinkTraffic | None = None
    notes: tuple[str, ...] = ()


def type_colours(models: Sequence[str]) -> dict[str, str]:
    """A colour per GPU model: fixed for catalog models, a name hash for the others (two
    models of one picture never share a colour)."""
    out: dict[str, str] = {}
    for m in dict.fromkeys(models):
        colour = _TYPE_COLOURS.get(m)
        if colour is None or colour in out.values():
            start = zlib.crc32(m.encode())
            spare = [*_SPARE_COLOURS, *_TYPE_COLOURS.values()]
            free = [c for k in range(len(spare)) if (c := spare[(start + k) % len(spare)])]
            colour = next((c for c in free if c not in out.values()), free[0])
        out[m] = colour
    return out


def _model_for(plan: Plan, model: ModelSpec | None) -> ModelSpec | None:
    """The plan's model: the one given, else its preset; None when neither matches."""
    candidate = model
    if candidate is None:
        try:
            candidate = preset(plan.model)
        except InputError:
            return None
    if candidate.moe_layers != plan.moe_layers or candidate.num_experts != plan.num_experts:
        return None
    return candidate


def _load_for(
    plan: Plan, model: ModelSpec | None, load: Sequence[Sequence[float]] | None
) -> Grid | None:
    """``[moe_layer][expert]`` load of the plan, when given or regenerable."""
    if load is not None:
        return tuple(tuple(float(x) for x in row) for row in load)
    source = str(plan.workload.get("load_source", ""))
    if source == "uniform":
        return tuple(tuple(1.0 for _ in range(plan.num_experts)) for _ in plan.moe_layers)
    if source.startswith("synthetic:") and model is not None:
        try:
            rows = synthetic_zipf(model, source)
        except InputError:
            return None
        return tuple(tuple(row) for row in rows)
    return None


def _stand_in_fleet(plan: Plan) -> Fleet | None:
    """A fleet of the plan's GPUs with catalog figures and no links; None when a GPU model
    is not in the catalog."""
    nodes: dict[str, list[Gpu]] = {}
    for g in plan.gpus:
        try:
            spec = lookup(g.model)
        except InputError:
            return None
        members = nodes.setdefault(g.node, [])
        members.append(Gpu(GpuId(g.gpu), g.node, len(members), spec))
    return Fleet(
        plan.fleet,
        tuple(Node(name, tuple(gpus), None, ()) for name, gpus in nodes.items()),
    )


def _check_inputs(plan: Plan, rows: Sequence[Sequence[float]] | None, fleet: Fleet | None) -> None:
    """Raise :class:`InputError` when the load or the fleet does not match the plan."""
    n_layers = len(plan.moe_layers)
    if rows is not None and (
        len(rows) != n_layers or any(len(r) != plan.num_experts for r in rows)
    ):
        raise InputError(
            f"load has shape [{len(rows)}][...]; the plan has {n_layers} MoE layers of "
            f"{plan.num_experts} experts",
            field="load",
        )
    if fleet is not None and [g.id for g in fleet.gpus] != [g.gpu for g in plan.gpus]:
        raise InputError(
            f"fleet {fleet.name!r} does not have the plan's GPUs (plan fleet {plan.fleet!r}). "
            "To fix: give the fleet file the plan was solved for",
            field="fleet",
        )


def _table(plan: Plan, m: ModelSpec, rows: Sequence[Sequence[float]], fleet: Fleet) -> CostTable:
    """The cost table of the plan's workload on ``fleet`` with load ``rows``."""
    wl = plan.workload
    workload = make_workload(
        m,
        phase=str(wl.get("phase", "decode")),
        tokens_per_gpu=int(wl.get("tokens_per_gpu", 1)),
        context_len=int(wl.get("context_len", 1)),
        load=rows,
        kv_cache_dtype=str(wl.get("kv_cache_dtype", "bf16")),
    )
    tp = [g.attention_tp for g in plan.gpus]
    if all(k == 1 for k in tp):
        return build_cost_table(fleet, m, workload)
    return tp_cost_table(fleet, m, workload, None, tp)


def _memory(plan: Plan) -> Grid:
    keys = ("weights", "experts", "kv_cache", "activations", "usable")
    return tuple(tuple(float(g.memory_bytes.get(k, 0.0)) for k in keys) for g in plan.gpus)


def _title(plan: Plan) -> str:
    s = plan.summary
    engine = plan.engine.name + (f" {plan.engine.version}" if plan.engine.version else "")
    return (
        f"{plan.fleet} / {plan.model} / {s.policy} ({s.form}, {engine}) - step "
        f"{s.step_time_us / 1e3:.1f} ms, {s.tokens_per_s:,.0f} tokens/s"
        + ("" if s.feasible else " - INFEASIBLE")
    )


def plan_picture(
    plan: Plan,
    *,
    model: ModelSpec | None = None,
    load: Sequence[Sequence[float]] | None = None,
    fleet: Fleet | None = None,
    layer: int | None = None,
) -> PlanPicture:
    """Compute what :func:`render_plan` draws.

    Args:
        plan: the plan.
        model: the plan's model when it is not a preset (``--model-config``).
        load: ``[moe_layer][expert]`` load when the plan's came from a file.
        fleet: the plan's fleet, for its links and exact GPU figures (else catalog figures
            and no dispatch+combine phase).
        layer: model layer index of the placement panel; None: the MoE layer that takes
            longest (the first MoE layer when times are unknown).

    Raises:
        InputError: ``fleet``, ``load`` or ``layer`` does not match the plan.
    """
    n_layers = len(plan.moe_layers)
    m = _model_for(plan, model)
    rows = _load_for(plan, m, load)
    _check_inputs(plan, rows, fleet)
    if layer is not None and layer not in plan.moe_layers:
        raise InputError(
            f"layer {layer} is not a MoE layer of {plan.model}. To fix: choose one of "
            f"{plan.moe_layers[0]}..{plan.moe_layers[-1]}"
            if plan.moe_layers
            else f"{plan.model} has no MoE layers: leave --layer out",
            field="layer",
        )
    placements = [
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in plan.gpus))
        for li in range(n_layers)
    ]
    labels = tuple(g.gpu for g in plan.gpus)
    base = PlanPicture(
        gpu_labels=labels,
        gpu_models=tuple(g.model for g in plan.gpus),
        layer_labels=plan.moe_layers,
        load=tuple(
            tuple(sum(s.share for s in g.experts[li]) for li in range(n_layers)) for g in plan.gpus
        ),
        load_title="experts served (sum of replica token shares; load unknown)",
        time=tuple(tuple(float(len(g.experts[li])) for li in range(n_layers)) for g in plan.gpus),
        time_title="expert replica slots (predicted time needs model and load)",
        attention_share=tuple(g.attention_share for g in plan.gpus),
        title=_title(plan),
        memory_bytes=_memory(plan),
    )
    stand_in = fleet or _stand_in_fleet(plan)
    if m is None or rows is None or stand_in is None:
        missing = "model (--model-config)" if m is None else "load (--load)"
        if m is not None and rows is not None:
            missing = "catalog figures for every GPU model (--fleet)"
        li = plan.moe_layers.index(layer) if layer is not None else 0
        view = expert_view(plan, rows, li, None) if n_layers else None
        return _with(base, experts=view, notes=(f"phase times need the {missing}",))
    return _predicted(plan, base, m, rows, stand_in, placements, fleet is not None, layer)


def _with(pic: PlanPicture, **changes: object) -> PlanPicture:
    from dataclasses import replace

    return replace(pic, **changes)  # type: ignore[arg-type]


def _predicted(
    plan: Plan,
    base: PlanPicture,
    m: ModelSpec,
    rows: Sequence[Sequence[float]],
    fleet: Fleet,
    placements: Sequence[LayerPlacement],
    comm_known: bool,
    layer: int | None,
) -> PlanPicture:
    """``base`` with the cost model's phase times, traffic and expert loads added."""
    table = _table(plan, m, rows, fleet)
    layers = executed_layers(plan, m, table, placements)
    shares = [g.attention_share for g in plan.gpus]
    ev = evaluate(table, shares, layers, runtime_of_plan(plan).exchange_in(table.decode))
    n_layers = len(plan.moe_layers)
    pairs = table.total_tokens * table.top_k
    served = [served_fractions(table, li, layers[li]) for li in range(n_layers)]
    n = len(plan.gpus)
    load_grid = tuple(tuple(served[li][i] * pairs for li in range(n_layers)) for i in range(n))
    time_grid = tuple(
        tuple(ev.moe_layers[li].expert_us[i] for li in range(n_layers)) for i in range(n)
    )
    if layer is not None:
        li = plan.moe_layers.index(layer)
    else:
        li = max(range(n_layers), key=lambda k: ev.moe_layers[k].layer_us, default=0)
    notes = []
    step = ev.step_time_us
    if not comm_known:
        step -= sum(max(max(t.comm_us, default=0.0), t.link_us) for t in ev.moe_layers)
        notes.append("dispatch+combine left out: link times need the fleet (--fleet)")
    elif abs(step - plan.summary.step_time_us) > 0.01 * max(plan.summary.step_time_us, 1e-9):
        notes.append(
            f"recomputed step {step / 1e3:.1f} ms differs from the plan's "
            f"{plan.summary.step_time_us / 1e3:.1f} ms (fleet or cost settings changed?)"
        )
    figures = "fleet figures" if comm_known else "catalog figures"
    return _with(
        base,
        load=load_grid,
        load_title="token-expert pairs served per step",
        time=time_grid,
        time_title=f"predicted expert-phase time, us ({figures})",
        phases=phases(ev, base.gpu_labels, base.gpu_models, comm_known),
        step_us=step,
        busy_us=busy(ev, n, comm_known),
        experts=expert_view(plan, rows, li, pairs) if n_layers else None,
        links=links(plan, table, layers, comm_known),
        notes=tuple(notes),
    )


def render_plan(
    plan: Plan,
    out: str | Path,
    *,
    model: ModelSpec | None = None,
    load: Sequence[Sequence[float]] | None = None,
    fleet: Fleet | None = None,
    layer: int | None = None,
) -> Path:
    """Draw the plan (see module docstring) into a PNG or SVG file (by ``out``'s suffix).

    Args:
        plan: the plan.
        out: ``.png`` or ``.svg`` path (parent directories are created).
        model, load, fleet, layer: see :func:`plan_picture`.

    Returns:
        The path written.

    Raises:
        InputError: inputs that do not match the plan, or the file cannot be written.
    """
    from controlplane.cli.plan_figure import draw_plan  # matplotlib is slow to import

    pic = plan_picture(plan, model=model, load=load, fleet=fleet, layer=layer)
    return save_png(draw_plan(pic, type_colours(pic.gpu_models)), out, "--out")


def save_png(fig: Figure, out: str | Path, flag: str) -> Path:
    """Write ``fig`` to ``out`` (SVG when the name ends ``.svg``, else PNG at 110 dpi),
    creating its folder.

    Raises:
        InputError: the path cannot be written (the message names ``flag`` to change).
    """
    path = Path(out)
    fmt = "svg" if path.suffix.lower() == ".svg" else "png"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format=fmt, dpi=110)
    except OSError as exc:
        raise InputError(
            f"cannot write the picture to {str(path)!r}: {exc.strerror or exc}. To fix: "
            f"choose a writable path with {flag}"
        ) from exc
    return path
