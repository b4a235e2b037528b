"""Drawing of ``mixfleetctl plan render`` (matplotlib, Agg canvas; no display needed).

:func:`draw_plan` lays out the panels of a :class:`controlplane.cli.render.PlanPicture`:

* top: the predicted step as one bar split by phase, each phase with its slowest GPU;
* middle, one row per GPU (plan order, node boundaries as lines, labels in the GPU type's
  colour): where the hottest experts of one layer sit, expert-phase time per MoE layer
  (slowest GPU of each layer marked), time per phase, memory against usable memory with
  the headroom written out, attention share;
* bottom: dispatch+combine bytes per step between nodes with the channel used, the GPU type
  legend and the picture's caveats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from controlplane.cli.plan_panels import TIE, PhaseSlice
from controlplane.cli.render import PlanPicture

GIB = float(2**30)
#: Phase colours: light tones, apart from the saturated GPU type colours.
PHASE_COLOURS = {
    "dense attention": "#c6dbef",
    "attention": "#6baed6",
    "dispatch+combine": "#fdae6b",
    "experts": "#74c476",
}
MEMORY_PARTS = (
    ("weights", "#bdbdbd"),
    ("experts", "#9e9ac8"),
    ("KV cache", "#4292c6"),
    ("activations", "#fed976"),
)
_MAX_ROW_LABELS = 64
_MAX_ANNOTATED_NODES = 12


def draw_plan(pic: PlanPicture, colours: dict[str, str]) -> Figure:
    """The whole picture of ``pic``; ``colours`` maps GPU model -> colour."""
    n = len(pic.gpu_labels)
    rows_h = min(30.0, max(3.5, 0.2 * n + 1.6))
    nodes = len(pic.links.nodes) if pic.links is not None else 0
    links_h = 3.2 if nodes <= _MAX_ANNOTATED_NODES else min(10.0, 0.18 * nodes + 1.5)
    fig = Figure(figsize=(22.0, 1.9 + rows_h + links_h), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(pic.title, fontsize=13)
    grid = fig.add_gridspec(
        3, 5, height_ratios=[1.9, rows_h, links_h], width_ratios=[5.0, 4.0, 2.4, 2.6, 1.5]
    )
    _phase_bar(fig.add_subplot(grid[0, :]), pic)
    ax_exp = fig.add_subplot(grid[1, 0])
    others = [fig.add_subplot(grid[1, k], sharey=ax_exp) for k in range(1, 5)]
    _experts(fig, ax_exp, pic)
    _times(fig, others[0], pic)
    _busy(others[1], pic)
    _memory(others[2], pic)
    _attention(others[3], pic, colours)
    _gpu_rows(ax_exp, others, pic, colours)
    _links(fig, fig.add_subplot(grid[2, 0:2]), pic)
    _legend(fig.add_subplot(grid[2, 2:]), pic, colours)
    return fig


def _phase_bar(ax: Axes, pic: PlanPicture) -> None:
    """One bar: the step split by phase, labelled with each phase's slowest GPU."""
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if not pic.phases:
        ax.set_xticks([])
        ax.text(
            0.5,
            0.5,
            f"step time by phase: {pic.notes[0] if pic.notes else 'unknown'}",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=11,
        )
        return
    total = sum(p.total_us for p in pic.phases) or 1.0
    known = [p for p in pic.phases if p.known]
    top = max(known, key=lambda p: p.total_us)
    unknown = (
        " + dispatch/combine (unknown without --fleet)" if len(known) < len(pic.phases) else ""
    )
    left = 0.0
    for p in pic.phases:
        width = p.total_us / 1e3 if p.known else total / 1e3 * 0.08
        ax.barh(
            0,
            width,
            left=left,
            color=PHASE_COLOURS.get(p.name, "#dddddd"),
            edgecolor="black",
            hatch=None if p.known else "//",
            height=0.8,
        )
        ax.text(
            left + width / 2,
            0,
            _phase_label(p, total),
            ha="center",
            va="center",
            fontsize=9,
            clip_on=True,
        )
        left += width
    ax.set_xlim(0, left)
    ax.set_xlabel("ms of one predicted step (each phase of a layer waits for its slowest GPU)")
    ax.set_title(
        f"step {pic.step_us / 1e3:.1f} ms predicted{unknown} - set mostly by {top.name} "
        f"({top.total_us / total:.0%}); slowest GPU in it: {top.setter or '-'} "
        f"in {top.setter_layers} of {top.layers} layers",
        fontsize=11,
        loc="left",
    )


def _phase_label(p: PhaseSlice, total: float) -> str:
    if not p.known:
        return f"{p.name}\n? (--fleet)"
    if p.total_us / total < 0.06:
        return f"{p.total_us / 1e3:.1f}"
    head = f"{p.name}\n{p.total_us / 1e3:.1f} ms ({p.total_us / total:.0%})"
    if p.setter and p.total_us / total >= 0.12:
        head += f"\nslowest: {p.setter}\nin {p.setter_layers} of {p.layers} layers"
    return head


def _experts(fig: Figure, ax: Axes, pic: PlanPicture) -> None:
    """GPUs x hottest experts of one layer; replicated experts carry ``xN``."""
    view = pic.experts
    if view is None or not view.experts:
        ax.text(0.5, 0.5, "dense model: no experts", ha="center", transform=ax.transAxes)
        ax.set_xticks([])
        return
    data = np.ma.masked_equal(np.asarray(view.grid, dtype=float), 0.0)
    cmap = colormaps["viridis"].with_extremes(bad="white")
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap)
    fig.colorbar(image, ax=ax, location="bottom", shrink=0.8, pad=0.01, label=view.unit)
    labels = [
        f"{e} x{r}" if r > 1 else str(e) for e, r in zip(view.experts, view.replicas, strict=True)
    ]
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    for tick, r in zip(ax.get_xticklabels(), view.replicas, strict=True):
        if r > 1:
            tick.set_color("#d62728")
            tick.set_fontweight("bold")
    ax.set_xticks(np.arange(-0.5, len(labels), 1.0), minor=True)
    ax.grid(which="minor", axis="x", color="#eeeeee", linewidth=0.5)
    hot = sum(1 for r in view.replicas if r > 1)
    ax.set_title(
        f"layer {view.layer}: {len(labels)} hottest experts, {hot} replicated (red, xN)"
        + (f"; {view.hidden} colder single experts not drawn" if view.hidden else ""),
        fontsize=10,
    )
    ax.set_xlabel("expert (replicated first, then by load)")


def _times(fig: Figure, ax: Axes, pic: PlanPicture) -> None:
    """Expert-phase time per GPU and MoE layer; the slowest GPU of each layer marked."""
    if not pic.layer_labels:
        ax.text(0.5, 0.5, "dense model: no experts", ha="center", transform=ax.transAxes)
        ax.set_xticks([])
        return
    grid = np.asarray(pic.time, dtype=float)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma")
    fig.colorbar(image, ax=ax, location="bottom", shrink=0.8, pad=0.01)
    rows, cols = np.nonzero(grid >= grid.max(axis=0, keepdims=True) * (1 - TIE))
    ax.plot(cols, rows, "o", markersize=2.5, color="#00e5ff", linestyle="none")
    step = max(1, len(pic.layer_labels) // 12)
    ticks = list(range(0, len(pic.layer_labels), step))
    ax.set_xticks(ticks, [str(pic.layer_labels[t]) for t in ticks])
    ax.set_xlabel("model layer (MoE layers only); dots: slowest GPU(s) of the layer")
    ax.set_title(pic.time_title, fontsize=10)


def _busy(ax: Axes, pic: PlanPicture) -> None:
    """Each GPU's own time per phase over the step, ms (stacked)."""
    ax.set_title("GPU's own time per step, ms", fontsize=10)
    if not pic.busy_us:
        ax.text(0.5, 0.5, "needs model and load", ha="center", transform=ax.transAxes)
        return
    y = np.arange(len(pic.gpu_labels))
    left = np.zeros(len(y))
    for k, name in enumerate(("attention", "dispatch+combine", "experts")):
        values = np.asarray([row[k] for row in pic.busy_us]) / 1e3
        ax.barh(y, values, left=left, color=PHASE_COLOURS[name], label=name, height=0.8)
        left += values
    ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("ms (attention + dispatch/combine + experts)")


def _memory(ax: Axes, pic: PlanPicture) -> None:
    """Memory per GPU against usable memory, GiB, with the headroom written out."""
    ax.set_title("memory, GiB (| usable; free at right)", fontsize=10)
    mem = np.asarray(pic.memory_bytes, dtype=float) / GIB
    if mem.size == 0:
        return
    y = np.arange(mem.shape[0])
    left = np.zeros(len(y))
    for k, (name, colour) in enumerate(MEMORY_PARTS):
        ax.barh(y, mem[:, k], left=left, color=colour, label=name, height=0.8)
        left += mem[:, k]
    usable = mem[:, 4]
    ax.plot(usable, y, "|", color="black", markersize=9, markeredgewidth=2)
    limit = float(max(usable.max(), left.max())) * 1.25
    small = len(y) <= _MAX_ROW_LABELS
    for i, (used, cap) in enumerate(zip(left, usable, strict=True)):
        free = cap - used
        if small or free < 0:
            ax.text(
                limit * 0.985,
                i,
                f"{free:+.0f}" if free < 0 else f"{free:.0f}",
                va="center",
                ha="right",
                fontsize=7,
                color="#d62728" if free < 0 else "black",
            )
    ax.set_xlim(0, limit)
    ax.legend(fontsize=7, loc="lower left", ncols=2)
    ax.set_xlabel("GiB")


def _attention(ax: Axes, pic: PlanPicture, colours: dict[str, str]) -> None:
    y = range(len(pic.gpu_labels))
    ax.barh(y, pic.attention_share, color=[colours[m] for m in pic.gpu_models], height=0.8)
    ax.set_title("attention share", fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(3))
    ax.set_xlabel("fraction of step tokens")


def _gpu_rows(
    first: Axes, others: Sequence[Axes], pic: PlanPicture, colours: dict[str, str]
) -> None:
    """GPU labels (coloured by type) on the first panel; node boundaries on every panel."""
    n = len(pic.gpu_labels)
    shown = list(range(0, n, max(1, n // _MAX_ROW_LABELS)))
    first.set_yticks(shown, [pic.gpu_labels[i] for i in shown], fontsize=7)
    for tick, i in zip(first.get_yticklabels(), shown, strict=True):
        tick.set_color(colours[pic.gpu_models[i]])
    first.set_ylabel("GPU (label colour = GPU type)")
    first.set_ylim(n - 0.5, -0.5)
    nodes = [label.split("/")[0] for label in pic.gpu_labels]
    cuts = [i - 0.5 for i in range(1, n) if nodes[i] != nodes[i - 1]]
    for ax in [first, *others]:
        for c in cuts:
            ax.axhline(c, color="#444444", linewidth=0.6)
    for ax in others:
        ax.tick_params(labelleft=False)


def _links(fig: Figure, ax: Axes, pic: PlanPicture) -> None:
    """Dispatch+combine bytes per step between nodes, GB, with the channel of each pair."""
    links = pic.links
    if links is None:
        ax.axis("off")
        if not pic.layer_labels:
            why = "dense model, no expert traffic"
        elif not pic.busy_us:
            why = "needs the model and the load"
        else:
            why = "all-gather backend: every GPU receives every token of the step (a ring)"
        ax.text(0.0, 0.5, f"communication per link: {why}", fontsize=10)
        return
    gb = np.asarray(links.bytes_per_step, dtype=float) / 1e9
    image = ax.imshow(gb, cmap="Blues", aspect="auto", vmin=0)
    fig.colorbar(image, ax=ax, location="right", label="GB per step")
    k = len(links.nodes)
    ax.set_xticks(range(k), links.nodes, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(k), links.nodes, fontsize=8)
    if k <= _MAX_ANNOTATED_NODES:
        top = float(gb.max()) or 1.0
        for a in range(k):
            for b in range(k):
                ax.text(
                    b,
                    a,
                    f"{gb[a, b]:.2f} GB\n{links.channel[a][b]}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if gb[a, b] > 0.6 * top else "black",
                )
    ax.set_xlabel("node whose experts serve the tokens")
    ax.set_ylabel("node whose tokens")
    ax.set_title(
        f"communication per link: dispatch+combine bytes per step, all MoE layers ({links.note})",
        fontsize=10,
    )


def _legend(ax: Axes, pic: PlanPicture, colours: dict[str, str]) -> None:
    ax.axis("off")
    handles = [Patch(color=c, label=m) for m, c in colours.items()]
    ax.legend(handles=handles, loc="upper left", title="GPU type", fontsize=9)
    if pic.notes:
        ax.text(
            0.45,
            0.95,
            "notes:\n" + "\n".join(f"- {n}" for n in pic.notes),
            transform=ax.transAxes,
            va="top",
            fontsize=9,
            wrap=True,
        )
