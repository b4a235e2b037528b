"""``mixfleetctl plan render``: a picture of a plan.

Three panels sharing the GPU axis (rows in plan order, labels coloured by GPU type):

1. load: token-expert pairs each GPU serves per step in each MoE layer;
2. predicted expert-phase time per GPU per MoE layer, us;
3. attention share per GPU (bars, coloured by GPU type).

A plan stores the placement but not the expert load or per-layer times, so both are
rebuilt from the plan's own inputs: the model (the plan's model name when it is a preset,
or the model given), the load (``uniform`` and ``synthetic:zipf:...`` sources are
regenerated; a load file must be given again) and the GPUs (the catalog entry of each GPU
model, or the fleet given). Where an input is missing, panel 1 falls back to experts served
(sum of replica token shares) and panel 2 to replica slots per GPU - both exact from the
plan alone - and the panel titles say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from policies.catalog import lookup
from policies.costmodel import build_cost_table
from policies.errors import InputError
from policies.evaluation import LayerPlacement, served_fractions
from policies.fleet import Fleet, Gpu, GpuId, Node
from policies.models import ModelSpec, preset
from policies.plan import Plan
from policies.workload import make_workload, synthetic_zipf

#: A ``[gpu][moe_layer]`` grid of one panel.
Grid = tuple[tuple[float, ...], ...]

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")


@dataclass(frozen=True)
class PlanPicture:
    """The numbers a plan picture shows (rows: GPUs in plan order; columns: MoE layers).

    Attributes:
        gpu_labels: GPU ids.
        gpu_models: GPU catalog model per GPU.
        layer_labels: model layer index of each MoE layer.
        load: per GPU per MoE layer, the value of panel 1 (see ``load_title``).
        load_title: what ``load`` holds and its unit.
        time: per GPU per MoE layer, the value of panel 2 (see ``time_title``).
        time_title: what ``time`` holds and its unit.
        attention_share: per GPU, fraction of the step's tokens (sums to 1).
        title: headline (fleet, model, policy, step time, throughput).
    """

    gpu_labels: tuple[str, ...]
    gpu_models: tuple[str, ...]
    layer_labels: tuple[int, ...]
    load: tuple[tuple[float, ...], ...]
    load_title: str
    time: tuple[tuple[float, ...], ...]
    time_title: str
    attention_share: tuple[float, ...]
    title: str


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
) -> tuple[tuple[float, ...], ...] | None:
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
    """A fleet of the plan's GPUs with catalog figures (no links: expert-phase times do not
    depend on them); None when a GPU model is not in the catalog."""
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


def _predicted_grids(
    plan: Plan,
    m: ModelSpec,
    rows: Sequence[Sequence[float]],
    fleet: Fleet,
    placements: Sequence[LayerPlacement],
) -> tuple[Grid, Grid]:
    """``[gpu][moe_layer]`` token-expert pairs served per step and predicted expert-phase
    time (us), from the cost model on ``fleet`` with the plan's workload and ``rows``."""
    n_layers = len(plan.moe_layers)
    wl = plan.workload
    workload = make_workload(
        m,
        phase=str(wl.get("phase", "decode")),
        tokens_per_gpu=int(wl.get("tokens_per_gpu", 1)),
        context_len=int(wl.get("context_len", 1)),
        load=rows,
        kv_cache_dtype=str(wl.get("kv_cache_dtype", "bf16")),
    )
    table = build_cost_table(fleet, m, workload)
    pairs_per_layer = table.total_tokens * table.top_k
    served = [served_fractions(table, li, placements[li]) for li in range(n_layers)]
    load_grid = tuple(
        tuple(served[li][i] * pairs_per_layer for li in range(n_layers))
        for i in range(len(plan.gpus))
    )
    time_grid = tuple(
        tuple(
            table.expert_us(i, served[li][i] * pairs_per_layer, len(g.experts[li]))
            for li in range(n_layers)
        )
        for i, g in enumerate(plan.gpus)
    )
    return load_grid, time_grid


def plan_picture(
    plan: Plan,
    *,
    model: ModelSpec | None = None,
    load: Sequence[Sequence[float]] | None = None,
    fleet: Fleet | None = None,
) -> PlanPicture:
    """Compute what :func:`render_plan` draws.

    Args:
        plan: the plan.
        model: the plan's model when it is not a preset (``--model-config``).
        load: ``[moe_layer][expert]`` load when the plan's came from a file.
        fleet: the plan's fleet, for its exact GPU figures (else catalog figures).

    Raises:
        InputError: ``fleet`` or ``load`` does not match the plan.
    """
    n_layers = len(plan.moe_layers)
    m = _model_for(plan, model)
    rows = _load_for(plan, m, load)
    _check_inputs(plan, rows, fleet)
    placements = [
        LayerPlacement(tuple(tuple((s.expert, s.share) for s in g.experts[li]) for g in plan.gpus))
        for li in range(n_layers)
    ]
    slots = tuple(tuple(float(len(g.experts[li])) for li in range(n_layers)) for g in plan.gpus)
    load_grid = tuple(
        tuple(sum(s.share for s in g.experts[li]) for li in range(n_layers)) for g in plan.gpus
    )
    load_title = "experts served (sum of replica token shares; load unknown)"
    time_grid = slots
    time_title = "expert replica slots (predicted time needs model and load)"
    stand_in = fleet or _stand_in_fleet(plan)
    if m is not None and rows is not None and stand_in is not None and n_layers:
        load_grid, time_grid = _predicted_grids(plan, m, rows, stand_in, placements)
        load_title = "token-expert pairs served per step"
        figures = "fleet figures" if fleet is not None else "catalog figures"
        time_title = f"predicted expert-phase time, us ({figures})"
    s = plan.summary
    title = (
        f"{plan.fleet} / {plan.model} / {s.policy} ({s.form}) - step "
        f"{s.step_time_us / 1e3:.1f} ms, {s.tokens_per_s:,.0f} tokens/s"
        + ("" if s.feasible else " - INFEASIBLE")
    )
    return PlanPicture(
        gpu_labels=tuple(g.gpu for g in plan.gpus),
        gpu_models=tuple(g.model for g in plan.gpus),
        layer_labels=plan.moe_layers,
        load=load_grid,
        load_title=load_title,
        time=time_grid,
        time_title=time_title,
        attention_share=tuple(g.attention_share for g in plan.gpus),
        title=title,
    )


def _type_colours(models: Sequence[str]) -> dict[str, str]:
    """A colour per GPU model, in order of first appearance."""
    out: dict[str, str] = {}
    for m in models:
        if m not in out:
            out[m] = _PALETTE[len(out) % len(_PALETTE)]
    return out


def render_plan(
    plan: Plan,
    out: str | Path,
    *,
    model: ModelSpec | None = None,
    load: Sequence[Sequence[float]] | None = None,
    fleet: Fleet | None = None,
) -> Path:
    """Draw the plan (see module docstring) into a PNG file.

    Args:
        plan: the plan.
        out: PNG path (parent directories are created).
        model, load, fleet: see :func:`plan_picture`.

    Returns:
        The path written.

    Raises:
        InputError: inputs that do not match the plan, or the file cannot be written.
    """
    pic = plan_picture(plan, model=model, load=load, fleet=fleet)
    n = len(pic.gpu_labels)
    colours = _type_colours(pic.gpu_models)
    height = min(40.0, max(4.0, 0.22 * n + 2.0))
    fig = Figure(figsize=(16.0, height), layout="constrained")
    ax_load, ax_time, ax_attn = fig.subplots(
        1, 3, sharey=True, gridspec_kw={"width_ratios": [5.0, 5.0, 1.6]}
    )
    fig.suptitle(pic.title)
    for ax, grid, title, cmap in (
        (ax_load, pic.load, pic.load_title, "viridis"),
        (ax_time, pic.time, pic.time_title, "magma"),
    ):
        if pic.layer_labels:
            image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap)
            fig.colorbar(image, ax=ax, location="bottom", shrink=0.8, pad=0.01)
            step = max(1, len(pic.layer_labels) // 12)
            ticks = list(range(0, len(pic.layer_labels), step))
            ax.set_xticks(ticks, [str(pic.layer_labels[t]) for t in ticks])
            ax.set_xlabel("model layer (MoE layers only)")
        else:
            ax.text(0.5, 0.5, "dense model: no experts", ha="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=10)
    y = list(range(n))
    ax_attn.barh(y, pic.attention_share, color=[colours[m] for m in pic.gpu_models])
    ax_attn.set_title("attention share", fontsize=10)
    ax_attn.set_xlabel("fraction of step tokens")
    label_step = max(1, n // 64)
    shown = list(range(0, n, label_step))
    ax_load.set_yticks(shown, [pic.gpu_labels[i] for i in shown], fontsize=7)
    for tick, i in zip(ax_load.get_yticklabels(), shown, strict=True):
        tick.set_color(colours[pic.gpu_models[i]])
    ax_load.set_ylabel("GPU (label colour = GPU type)")
    if not pic.layer_labels:
        ax_load.set_ylim(n - 0.5, -0.5)
    fig.legend(
        handles=[Patch(color=to_hex(c), label=m) for m, c in colours.items()],
        loc="outside right upper",
        title="GPU type",
        fontsize=8,
    )
    return save_png(fig, out, "--out")


def save_png(fig: Figure, out: str | Path, flag: str) -> Path:
    """Write ``fig`` as a PNG (110 dpi) to ``out``, creating its folder.

    Raises:
        InputError: the path cannot be written (the message names ``flag`` to change).
    """
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=110)
    except OSError as exc:
        raise InputError(
            f"cannot write the picture to {str(path)!r}: {exc.strerror or exc}. To fix: "
            f"choose a writable path with {flag}"
        ) from exc
    return path
