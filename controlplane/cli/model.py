"""``mixfleetctl model list``: the model presets (or ``--model-config`` for any other)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from controlplane.cli.output import (
    Groups,
    add_group,
    add_leaf,
    add_output_arg,
    emit,
    emit_document,
    format_table,
)

if TYPE_CHECKING:
    from policies.model.architecture import ModelSpec


def _model_row(m: ModelSpec) -> dict[str, Any]:
    return {
        "name": m.name,
        "family": m.family,
        "layers": m.num_layers,
        "moe_layers": m.num_moe_layers,
        "experts": m.num_experts,
        "top_k": m.top_k,
        "hidden": m.hidden,
        "attention": m.attention,
        "weights": m.weight_dtype,
        "experts_dtype": m.expert_dtype,
        "total_params_b": round(m.total_params / 1e9, 1),
        "active_params_b": round(m.active_params / 1e9, 1),
    }


def cmd_model_list(args: argparse.Namespace) -> int:
    """``model list``: the presets."""
    from policies.model.architecture import PRESETS

    rows = [_model_row(m) for m in PRESETS.values()]
    if args.output != "table":
        emit_document(rows, args.output, [f"model/{r['name']}" for r in rows])
        return 0
    headers = list(rows[0])
    emit(format_table(headers, [[str(r[h]) for h in headers] for r in rows]))
    emit("Or --model-config PATH: a Hugging Face config.json or a Model file (docs/models.md).")
    return 0


def register(groups: Groups) -> None:
    """Add the ``model`` group."""
    model = add_group(groups, "model", "model presets")
    p = add_leaf(model, "list", cmd_model_list, "list the model presets")
    add_output_arg(p)
