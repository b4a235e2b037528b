"""Builders shared by the launch recipe tests (policies.launch): a small fleet, an engine
plan solved on it, and the ``--flag value`` pairs of a command line."""

from __future__ import annotations

from policies.estimate.engines import EngineSpec
from policies.estimate.workload import make_workload
from policies.hardware.fleet import Fleet, parse_fleet
from policies.model.architecture import ModelSpec, preset
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.solve import solve

QWEN = preset("qwen3-30b-a3b")
MIXTRAL = preset("mixtral-8x7b")


def fleet(*nodes: tuple[str, str, int]) -> Fleet:
    """``(name, GPU model, count)`` nodes on one fabric."""
    return parse_fleet(
        {
            "metadata": {"name": "f"},
            "spec": {
                "nodes": [
                    {
                        "name": name,
                        "gpus": [{"model": gpu, "count": count}],
                        "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
                        "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib"}],
                    }
                    for name, gpu, count in nodes
                ]
            },
        }
    )


H100X2 = fleet(("h0", "H100-SXM5-80GB", 2), ("h1", "H100-SXM5-80GB", 2))


def plan_for(
    engine: EngineSpec,
    f: Fleet = H100X2,
    model: ModelSpec = QWEN,
    redundant: int = 4,
) -> Plan:
    req = PlacementRequest(
        fleet=f,
        model=model,
        workload=make_workload(model, phase="decode", tokens_per_gpu=32, context_len=2048),
        policy="greedy",
        form="engine",
        redundant_experts=redundant,
        engine=engine,
    )
    plan = solve(req).plan
    assert plan.engine.name == engine.name and not plan.violations
    return plan


def flags(argv: tuple[str, ...]) -> dict[str, str]:
    """``--flag value`` pairs (a flag followed by another flag maps to "")."""
    out: dict[str, str] = {}
    for i, tok in enumerate(argv):
        if tok.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else "--"
            out[tok] = "" if nxt.startswith("--") else nxt
    return out
