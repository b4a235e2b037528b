"""Safety net of the ``ilp`` policy against the EPLB baseline, under the engine's own rules.

Stage 2 of the ILP optimises each layer under its own model of the phases; when the engine
balances DP ranks itself (equal shares) or splits replicas evenly, the EPLB layout - which
balances served pairs, and so the dispatch+combine phase - can realise better on some
layers. :func:`mix_layers` keeps, per MoE layer, the better of the policy's layer and the
EPLB layer under the policy's attention shares (scored with
:func:`policies.estimate.evaluation.layer_exchange_us`, replica shares as the engine splits them).
The caller then compares whole plans with the exact execution model, so the ``ilp`` policy
is never worse than the baseline it is measured against, and its notes say how many layers
came from EPLB.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from policies.estimate.costmodel import CostTable
from policies.estimate.evaluation import LayerPlacement, layer_exchange_us
from policies.request import RawPlacement


def _even(layer: LayerPlacement) -> LayerPlacement:
    """The layer with every replica serving an equal share of its expert."""
    count: dict[int, int] = {}
    for slots in layer.per_gpu:
        for e, _ in slots:
            count[e] = count.get(e, 0) + 1
    return LayerPlacement(
        tuple(tuple((e, 1.0 / count[e]) for e, _ in slots) for slots in layer.per_gpu)
    )


def mix_layers(
    table: CostTable,
    share: Sequence[float],
    ours: RawPlacement,
    baseline: RawPlacement,
    *,
    even: bool,
    exchange: str = "alltoall",
) -> RawPlacement | None:
    """``ours`` with each layer replaced by the baseline's where that realises better under
    ``share``; None when no layer improves.

    Args:
        table: cost table.
        share: per GPU the executed attention share.
        ours: the policy's answer.
        baseline: the EPLB answer (same slots per GPU).
        even: the engine splits replicas evenly (score both layers with even shares).
        exchange: the backend's token exchange (``alltoall`` or ``allgather``).
    """
    layers = list(ours.layers)
    taken = 0
    for li, (mine, theirs) in enumerate(zip(ours.layers, baseline.layers, strict=True)):
        a = _even(mine) if even else mine
        b = _even(theirs) if even else theirs
        theirs_us = layer_exchange_us(table, share, li, b, exchange)
        if theirs_us < layer_exchange_us(table, share, li, a, exchange) - 1e-9:
            layers[li] = theirs
            taken += 1
    if not taken:
        return None
    note = f"{taken} layer(s) took the EPLB layout, which realised better under the engine's rules"
    return replace(ours, layers=tuple(layers), notes=(*ours.notes, note))
