"""``uniform``: what engines do today with identical-GPU assumptions.

Equal attention share per GPU. Engine form: SGLang's trivial initial location - physical
slot p holds logical expert ``p mod E`` and lives on GPU ``p // slots_per_gpu``; with no
redundant slots that is exactly expert e on GPU ``e // (E / G)``. Native form: expert e on
GPU ``floor(e * G / E)``, no replicas. Load is ignored.
"""

from __future__ import annotations

from policies.estimate.costmodel import CostTable
from policies.estimate.evaluation import LayerPlacement
from policies.request import PlacementRequest, RawPlacement
from policies.solvers.common import engine_layer


def place(req: PlacementRequest, table: CostTable) -> RawPlacement:
    """Uniform placement (see module docstring)."""
    n = table.num_gpus
    e_count = table.num_experts
    share = tuple(1.0 / n for _ in range(n))
    layers: list[LayerPlacement] = []
    for _ in range(table.num_moe_layers):
        if req.form == "engine":
            phy = [p % e_count for p in range(e_count + req.redundant_experts)]
            layers.append(engine_layer(phy, n))
        else:
            per: list[list[tuple[int, float]]] = [[] for _ in range(n)]
            for e in range(e_count):
                per[e * n // e_count].append((e, 1.0))
            layers.append(LayerPlacement(tuple(tuple(x) for x in per)))
    return RawPlacement(share, tuple(layers), solver="uniform (no solver)")
