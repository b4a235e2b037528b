"""The fleets and EPLB decode plans the conformance tests hand to the engines' own code."""

from __future__ import annotations

from collections.abc import Sequence

from policies.estimate.engines import EngineName, EngineSpec
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import ModelSpec
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.solve import solve

H100 = "H100-SXM5-80GB"


def fleet_of(
    name: str, nodes: Sequence[tuple[str, str, int]], *, nvlink_gbytes_per_s: float = 900
) -> Fleet:
    """A fleet of ``(node name, GPU model, GPU count)`` nodes, each with one 400 Gbit/s NIC on
    fabric ``ib0`` and ``nvlink_gbytes_per_s`` (GB/s, bidirectional, per GPU) of NVLink."""
    nic = [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}]
    return parse_fleet(
        {
            "metadata": {"name": name},
            "spec": {
                "nodes": [
                    {
                        "name": node,
                        "gpus": [{"model": gpu, "count": count}],
                        "nvlink": {"per_gpu_bidir_gbytes_per_s": nvlink_gbytes_per_s},
                        "nics": nic,
                    }
                    for node, gpu, count in nodes
                ]
            },
        }
    )


def eplb_plan(
    model: ModelSpec, fleet: Fleet, *, engine: EngineName, zipf: str, redundant: int
) -> Plan:
    """The ``eplb`` decode plan (64 tokens per GPU, 2048-token context) of ``model`` on
    ``fleet`` for ``engine``, under the synthetic load ``zipf`` (a ``synthetic:zipf:...``
    spec); asserts it has no violation."""
    load = synthetic_zipf(model, zipf)
    workload = make_workload(model, phase="decode", tokens_per_gpu=64, context_len=2048, load=load)
    req = PlacementRequest(
        fleet,
        model,
        workload,
        policy="eplb",
        redundant_experts=redundant,
        engine=EngineSpec(engine),
    )
    plan = solve(req).plan
    assert not plan.violations, plan.violations
    return plan
