"""``eplb``: DeepSeek's Expert Parallelism Load Balancer as engines run it today.

Same slot budget and load as every policy; assumes identical GPUs: equal attention shares,
equal slots per GPU, replicas share an expert's tokens equally. Hierarchical (groups packed
onto nodes, then replication and packing inside each node) when the model's expert groups
divide evenly over the nodes and every node has the same number of GPUs; global otherwise.
The native form is the same placement (EPLB has no notion of unequal shares).
"""

from __future__ import annotations

from policies.estimate.costmodel import CostTable
from policies.estimate.evaluation import LayerPlacement
from policies.request import PlacementRequest, RawPlacement
from policies.solvers.common import engine_layer
from policies.solvers.eplb_core import rebalance_experts


def _merge_duplicates(layer: LayerPlacement) -> LayerPlacement:
    per_gpu = []
    for slots in layer.per_gpu:
        merged: dict[int, float] = {}
        for e, share in slots:
            merged[e] = merged.get(e, 0.0) + share
        per_gpu.append(tuple(merged.items()))
    return LayerPlacement(tuple(per_gpu))


def place(req: PlacementRequest, table: CostTable) -> RawPlacement:
    """EPLB placement (see module docstring)."""
    n = table.num_gpus
    nodes = req.fleet.nodes
    equal_nodes = len({len(nd.gpus) for nd in nodes}) == 1
    groups = req.model.n_group if req.model.n_group > 1 else 1
    num_nodes = len(nodes) if equal_nodes else 1
    if groups % num_nodes != 0 or table.num_experts % groups != 0:
        groups, num_nodes = 1, 1
    share = tuple(1.0 / n for _ in range(n))
    physical = table.num_experts + req.redundant_experts
    if physical % n != 0:  # native form: the largest equal-slot budget within the request
        physical = max(physical // n * n, -(-table.num_experts // n) * n)
    weight = [
        [table.pairs(li, e) for e in range(table.num_experts)] for li in range(table.num_moe_layers)
    ]
    layers: tuple[LayerPlacement, ...] = ()
    mode = "hierarchical" if num_nodes > 1 else "global"
    if weight:
        phy2log, _, _ = rebalance_experts(weight, physical, groups, num_nodes, n)
        layers = tuple(engine_layer(row, n) for row in phy2log)
        if req.form == "native":  # EPLB may put two replicas of an expert on one GPU: merge
            layers = tuple(_merge_duplicates(layer) for layer in layers)
    return RawPlacement(share, layers, solver=f"eplb {mode} (no solver)")
