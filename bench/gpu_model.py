"""What the one-GPU measurements of :mod:`bench.gpu` are compared with: the one MoE layer
of each model the fast runtime executes (:func:`layer_model`), the cost model's per-phase
prediction for it on one GPU with calibrated figures (:func:`predict`), and the tables of
the results file (:func:`fidelity_table`, :func:`roofline_table`). Pure: no torch.

Units: microseconds (``_us``), fractions for errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from agents.calibrate.fit import layer_phase_times
from policies.model.architecture import ModelSpec, preset

GPU_MODEL = "H200-SXM-141GB"

#: The models of the fidelity runs: preset name and the attention the runtime runs for it.
#: DeepSeek-V3's MLA runs as GQA with 8 KV heads of 128 (its q heads and widths kept);
#: Qwen3-235B-A22B is GQA already.
MODELS: Mapping[str, Mapping[str, Any]] = {
    "deepseek-v3": {"num_kv_heads": 8, "head_dim": 128},
    "qwen3-235b-a22b": {},
}


def layer_model(name: str, expert_dtype: str = "bf16") -> ModelSpec:
    """One MoE layer of preset ``name`` as the fast runtime executes it (GQA attention,
    BF16 attention weights, experts in ``expert_dtype``)."""
    base = preset(name)
    gqa = MODELS[name]
    return replace(
        base,
        name=f"{name}-layer",
        num_layers=1,
        moe_layers=(0,),
        attention="gqa",
        num_kv_heads=gqa.get("num_kv_heads", base.num_kv_heads),
        head_dim=gqa.get("head_dim", base.head_dim),
        v_head_dim=gqa.get("head_dim", base.head_dim),
        q_lora_rank=0,
        kv_lora_rank=0,
        qk_rope_dim=0,
        weight_dtype="bf16",
        expert_dtype=expert_dtype,
    )


def predict(
    model: ModelSpec,
    *,
    decode: bool,
    tokens: int,
    context: int,
    figures: Mapping[str, float],
) -> dict[str, float]:
    """The cost model's phase times for ``model``'s layer on one H200 holding every expert
    once (:func:`agents.calibrate.fit.layer_phase_times`), microseconds."""
    return layer_phase_times(
        model, decode=decode, tokens=tokens, context=context, figures=figures, gpu_model=GPU_MODEL
    )


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def fidelity_table(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown rows: per case, attention and expert phase measured vs predicted."""
    rows = [
        "| model | experts | phase | attention us (pred, err) | expert phase us (pred, err) "
        "| layer us (pred, err) |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        if "error" in c:
            rows.append(
                f"| {c['model']} | {c['expert_dtype']} | {c['phase']} | error: "
                f"{c['error'][:60]} | | |"
            )
            continue
        m, p = c["measured"], c["predicted"]
        rows.append(
            f"| {c['model']} | {c['expert_dtype']} | {c['phase']} "
            f"| {m['attention']:.0f} ({p['attention_us']:.0f}, {_err(p['attention_us'], m['attention']):+.1%}) "
            f"| {m['expert_phase']:.0f} ({p['expert_us']:.0f}, {_err(p['expert_us'], m['expert_phase']):+.1%}) "
            f"| {m['layer']:.0f} ({p['layer_us']:.0f}, {_err(p['layer_us'], m['layer']):+.1%}) |"
        )
    return rows


def roofline_table(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown rows: per runtime case, each phase's measured time over its roofline."""
    rows = [
        "| case | attention us / roof | experts (+dispatch) us / roof | combine us / roof "
        "| layer us / roof (ratio) | eager us |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        if "error" in c:
            rows.append(f"| {c['label']} | error: {c['error'][:60]} | | | | |")
            continue
        m, r = c["graph_us"], c["roofline_us"]
        ex = m["dispatch"] + m["experts"]
        rex = r["dispatch"] + r["experts"]
        rows.append(
            f"| {c['label']} | {m['attention']:.0f} / {r['attention']:.0f} "
            f"| {ex:.0f} / {rex:.0f} | {m['combine']:.0f} / {r['combine']:.0f} "
            f"| {m['layer']:.0f} / {r['layer']:.0f} ({m['layer'] / r['layer']:.2f}x) "
            f"| {c.get('eager_us', float('nan')):.0f} |"
        )
    return rows
