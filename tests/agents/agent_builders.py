"""Builders for agent tests: small fleets and plans that solve in milliseconds."""

from __future__ import annotations

from dataclasses import replace

from policies.estimate.workload import make_workload
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import preset
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.solve import solve


def small_fleet(nodes: int = 2, gpus_per_node: int = 2, model: str = "H100-SXM5-80GB") -> Fleet:
    """``nodes`` NVLink nodes of ``gpus_per_node`` GPUs on one InfiniBand fabric."""
    return parse_fleet(
        {
            "metadata": {"name": "small"},
            "spec": {
                "nodes": [
                    {
                        "name": f"n{i}",
                        "labels": {"rack": f"r{i % 2}"},
                        "gpus": [{"model": model, "count": gpus_per_node}],
                        "nvlink": {"domain": f"n{i}", "per_gpu_bidir_gbytes_per_s": 900},
                        "nics": [{"count": 2, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
                    }
                    for i in range(nodes)
                ]
            },
        }
    )


def small_plan(fleet: Fleet | None = None, *, version: int = 1, policy: str = "greedy") -> Plan:
    """A Mixtral-8x7B engine-form plan on ``fleet`` (default: 2 nodes x 2 H100)."""
    fleet = fleet or small_fleet()
    model = preset("mixtral-8x7b")
    workload = make_workload(model, phase="decode", tokens_per_gpu=64, context_len=4096)
    g = len(fleet.gpus)
    redundant = (-model.num_experts) % g
    req = PlacementRequest(fleet, model, workload, policy=policy, redundant_experts=redundant)
    return replace(solve(req).plan, version=version)
