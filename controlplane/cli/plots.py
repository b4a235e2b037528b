"""Pictures of the strategy reports (matplotlib, Agg canvas; no display needed).

:func:`render_batch_curve` draws ``mixfleetctl advise batch --png``: throughput (tokens/s)
and step time (ms) against tokens per GPU, with the target, the equal-split start and the
largest batch marked, and the batches that do not fit memory shown apart.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from controlplane.cli.render import save_png
from policies.advice.advise import BatchAdvice


def render_batch_curve(advice: BatchAdvice, out: str | Path, *, title: str = "") -> Path:
    """Write the batch-size curve as a PNG and return its path.

    Raises:
        InputError: the file cannot be written.
    """
    fig = Figure(figsize=(9.0, 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax2 = ax.twinx()
    solved = [p for p in advice.points if p.step_time_us is not None]
    fits = [p for p in solved if p.fits_memory]
    xs = [p.tokens_per_gpu for p in fits]
    ax.plot(xs, [p.tokens_per_s for p in fits], "o-", color="#1f77b4", label="tokens/s")
    ax2.plot(
        xs, [(p.step_time_us or 0.0) / 1e3 for p in fits], "s--", color="#d62728", label="step ms"
    )
    missing = [p.tokens_per_gpu for p in advice.points if not p.fits_memory]
    for x in missing:
        ax.axvline(x, color="#7f7f7f", alpha=0.25, linewidth=6)
    if missing:
        ax.plot([], [], color="#7f7f7f", alpha=0.4, linewidth=6, label="does not fit memory")
    name = advice.target_name
    if advice.target_ms is not None:
        ax2.axhline(advice.target_ms, color="#d62728", linestyle=":", label=f"{name} target")
    ax.axvline(advice.start_tokens_per_gpu, color="#2ca02c", linestyle=":", label="equal-split fit")
    if advice.best is not None:
        ax.plot(
            [advice.best.tokens_per_gpu],
            [advice.best.tokens_per_s],
            marker="*",
            markersize=16,
            color="#ff7f0e",
            linestyle="none",
            label=f"largest: {advice.best.tokens_per_gpu} tokens/GPU",
        )
    ax.set_xscale("log")
    ax.set_xlabel("tokens per GPU per step")
    ax.set_ylabel("tokens/s (whole deployment)")
    ax2.set_ylabel(f"step time, ms ({name})")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, loc="upper left", fontsize="small")
    target = f"{name} <= {advice.target_ms:g} ms" if advice.target_ms is not None else "memory only"
    ax.set_title(title or f"batch sizing ({advice.phase}, {advice.policy}, {target})")
    return save_png(fig, out, "--png")
