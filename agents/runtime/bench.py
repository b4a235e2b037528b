"""Fidelity and heterogeneity measurements of docs/validation.md.

``python -m agents.runtime.bench --out DIR`` on a node with two NVLink-connected GPUs:

1. NVML discovery of the node (inventory and raw NVML answers).
2. Calibration of both GPUs (:mod:`agents.calibrate`), both at full speed.
3. For decode and prefill: ``uniform``, ``eplb`` and ``ilp`` plans (native form) solved
   from the calibrated inventory, each run in the reference runtime on a DeepSeek-V3-shaped
   MoE layer; per GPU and phase the measured time next to the cost model's prediction,
   with calibrated figures ("calibrated") and with catalog figures only ("catalog").
4. GPU 1 made slower (:mod:`agents.runtime.slowdown`: SMs taken away, or a co-running GEMM
   load), calibrated again under that load, plans solved again and run again.

Measurements run with phase barriers (a one-element all-reduce before dispatch and before
combine): each phase's time is the GPU's own work, and the layer time is the sum over
phases of the slowest GPU, as the cost model composes it. Free-running layer time (no
barriers) is reported too. Everything needed to recompute predictions offline (calibration
curves, plans, model, workloads) goes into the result JSON.

``--cpu`` runs the same pipeline on two CPU processes (gloo) with tiny dimensions and
made-up figures, for checking the code path without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from agents.calibrate import (
    CalibrationOptions,
    apply_calibration,
    measure_rank,
    planning_inputs,
    runtime_profile,
)
from agents.runtime.bench_config import BenchConfig, bench_model, workloads
from agents.runtime.bench_results import environment, report, summary
from policies.estimate.costmodel import CostSettings, build_cost_table
from policies.estimate.evaluation import evaluate
from policies.estimate.workload import Workload
from policies.hardware.fleet import Fleet
from policies.hardware.inventory import inventory_from_dict, inventory_to_dict
from policies.model.architecture import ModelSpec
from policies.plan import Plan, plan_from_dict
from policies.request import PlacementRequest, SolverOptions
from policies.solve import solve

POLICIES = ("uniform", "eplb", "ilp")


# ----------------------------------------------------------------------------- planning


def solve_plans(
    c: BenchConfig, calibrations: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Plans per phase and policy from the calibrated inventory, with both predictions."""
    model = bench_model(c)
    inv = inventory_from_dict(c.inventory)
    cal = {
        "gpus": [
            {"index": r["index"], "uuid": r["uuid"], "measured": r["measured"]}
            for r in calibrations
        ]
    }
    inv = apply_calibration(inv, cal)
    fleet, settings = planning_inputs([inv], name="bench", fp8_dispatch=c.calib.fp8_dispatch)
    catalog_fleet = Fleet("bench-catalog", (inventory_from_dict(c.inventory).to_node(),))
    out: dict[str, dict[str, Any]] = {}
    for phase, wl in workloads(c, model).items():
        out[phase] = {}
        for policy in POLICIES:
            req = PlacementRequest(
                fleet=fleet,
                model=model,
                workload=wl,
                policy=policy,
                form="native",
                redundant_experts=c.redundant_experts,
                options=SolverOptions(time_limit_s=60.0, workers=1),
                settings=settings,
            )
            t0 = time.perf_counter()
            res = solve(req).require_placed()
            solve_s = time.perf_counter() - t0
            out[phase][policy] = {
                "plan": res.plan.to_dict(),
                "solve_s": solve_s,
                "predicted": predictions(fleet, model, wl, settings, res.plan),
                "predicted_catalog": predictions(
                    catalog_fleet,
                    model,
                    wl,
                    CostSettings(fp8_dispatch=c.calib.fp8_dispatch),
                    res.plan,
                ),
            }
    return out


def predictions(
    fleet: Fleet, model: ModelSpec, wl: Workload, settings: CostSettings, plan: Plan
) -> dict[str, Any]:
    """The cost model's per-GPU phase times for the plan's MoE layer, microseconds."""
    from policies.estimate.evaluation import LayerPlacement

    table = build_cost_table(fleet, model, wl, settings)
    layer = LayerPlacement(
        tuple(tuple((s.expert, s.share) for s in g.experts[0]) for g in plan.gpus)
    )
    ev = evaluate(table, [g.attention_share for g in plan.gpus], [layer])
    t = ev.moe_layers[0]
    return {
        "attention_us": list(t.attention_us),
        "comm_us": list(t.comm_us),
        "expert_us": list(t.expert_us),
        "busy_us": [
            a + b + e for a, b, e in zip(t.attention_us, t.comm_us, t.expert_us, strict=True)
        ],
        "layer_us": t.layer_us,
    }


# ------------------------------------------------------------------------------ running


def _device(rank: int, cpu: bool) -> Any:
    import torch

    return torch.device("cpu") if cpu else torch.device("cuda", rank)


@dataclass
class _Prepared:
    """One plan's layer, inputs and KV cache on this rank."""

    layer: Any
    x: Any
    cache: Any
    tokens: int
    slots: int


def prepare_plan(
    rank: int, world: int, c: BenchConfig, plan_doc: Mapping[str, Any], phase: str
) -> _Prepared:
    """Build one plan's MoE layer on this rank (weights, routing tables, inputs)."""
    import torch

    from agents.runtime.layer import LayerShape, MoeLayer, make_kv_cache, make_weights
    from agents.runtime.routing import build_tables, placement_from_plan

    plan = plan_from_dict(plan_doc)
    model = bench_model(c)
    shape = LayerShape.from_model(model)
    decode = phase == "decode"
    per_gpu = c.decode_tokens if decode else c.prefill_tokens
    placement = placement_from_plan(plan, 0, per_gpu * world)
    dev = _device(rank, c.cpu)
    dtype = torch.float32 if c.cpu else torch.bfloat16
    experts = [e for e, _ in placement.slots[rank]]
    weights = make_weights(shape, experts, device=dev, dtype=dtype, seeded_experts=c.cpu)
    tables = build_tables(placement, shape.num_experts, dev)
    tokens = placement.tokens[rank]
    x = torch.randn(tokens, shape.hidden, device=dev, dtype=dtype)
    cache = (
        make_kv_cache(shape, tokens, c.decode_context, device=dev, dtype=dtype, seed=rank)
        if decode
        else None
    )
    load = torch.ones(shape.num_experts)  # the workloads' uniform expert load
    layer = MoeLayer(
        shape,
        placement,
        rank,
        world,
        weights,
        tables,
        decode=decode,
        seq_len=c.prefill_seq,
        fp8_dispatch=plan.gpus[rank].hints.fp8_dispatch and not c.cpu,
        sync_phases=True,
        sample_logits=torch.log(load / load.sum()).to(dev),
    )
    return _Prepared(layer, x, cache, tokens, len(experts))


def measure_plan(p: _Prepared, c: BenchConfig) -> dict[str, Any]:
    """One round: ``warmup`` + ``iters`` steps with phase barriers (per-phase times) and as
    many without (free-running layer time), microseconds."""
    from agents.runtime.layer import PhaseTimer

    phases: list[dict[str, float]] = []
    free: list[float] = []
    for sync in (True, False):
        p.layer.sync_phases = sync
        for i in range(c.warmup + c.iters):
            timer = PhaseTimer(cuda=not c.cpu)
            p.layer.forward(p.x, p.cache, timer)
            if i >= c.warmup:
                if sync:
                    phases.append(timer.phases_us())
                else:
                    free.append(sum(timer.phases_us().values()))
    return {"phases": phases, "free": free}


def summarize(rank: int, p: _Prepared, rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over every timed step of every round."""
    phases = [ph for r in rounds for ph in r["phases"]]
    free = [f for r in rounds for f in r["free"]]
    med = {k: statistics.median(ph[k] for ph in phases) for k in phases[0]}
    busy = sum(v for k, v in med.items() if not k.startswith("wait"))
    per_round = [statistics.median(sum(ph.values()) for ph in r["phases"]) for r in rounds]
    return {
        "rank": rank,
        "tokens": p.tokens,
        "slots": p.slots,
        "phases_us": med,
        "attention_us": med["attention"],
        "comm_us": med["dispatch"] + med["combine"],
        "expert_us": med["experts"] + med["output"],
        "busy_us": busy,
        "layer_us": sum(med.values()),
        "layer_us_per_round": per_round,
        "free_layer_us": statistics.median(free),
        "steps": len(phases),
    }


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _calibrate_here(rank: int, world: int, c: BenchConfig) -> dict[str, Any]:
    """This rank's calibration (made-up figures in ``--cpu`` mode)."""
    import torch

    if c.cpu:  # made-up single-GPU figures; the runtime profile runs for real
        figs = {
            "gemm_bf16_tflops": 700.0,
            "hbm_gbytes_per_s": 4000.0,
            "nvlink_per_direction_gbytes_per_s": 300.0,
        }
        profile = runtime_profile(rank, world, c.calib, torch.device("cpu"))
        return {
            "index": rank,
            "uuid": "",
            "measured": figs,
            "curves": {},
            "nccl": None,
            "runtime_profile": profile,
            "duration_s": 0.0,
        }
    return measure_rank(rank, world, c.calib, torch.device("cuda", rank))


class _Guard:
    """Keeps GPU 1 slowed for one block of measurements at a time: a fresh slowdown before
    each block, and a check after it that the slowdown lasted (an SM hog that timed out
    means something waited for the whole device; the block is then measured again)."""

    def __init__(self, c: BenchConfig, rank: int) -> None:
        self.c = c
        self.rank = rank
        self.slow: Any = None
        self.method = c.slowdown
        self.events: list[dict[str, Any]] = []

    def start(self) -> None:
        from agents.runtime.slowdown import GemmLoad, SmHog

        self.stop()
        if self.method == "sm_hog":
            try:
                self.slow = SmHog(self.rank, self.c.hog_sms, max_s=self.c.hog_max_s)
                self.events.append({"start": self.slow.start()})
                return
            except Exception as exc:  # fall back to the co-running GEMM load
                self.events.append({"start_error": f"{type(exc).__name__}: {exc}"})
                self.method = "gemm_load"
        self.slow = GemmLoad(self.rank)
        self.events.append({"start": self.slow.start()})

    def lasted(self) -> bool:
        return self.slow is None or bool(self.slow.running())

    def stop(self) -> None:
        if self.slow is not None:
            self.events.append({"stop": self.slow.stop()})
            self.slow = None


def _guarded(guard: _Guard | None, fn: Any) -> tuple[Any, int]:
    """Run a measurement block (all ranks) under the guard; returns (result, attempts),
    attempts -1 when the slowdown did not last even on the second try."""
    result: Any = None
    for attempt in (1, 2):
        if guard is not None:
            guard.start()
        result = fn()
        ok = guard.lasted() if guard is not None else True
        if guard is not None:
            guard.stop()
        if all(_gather(ok)):
            return result, attempt
    return result, -1


def _scenario(
    rank: int, world: int, c: BenchConfig, label: str, guard: _Guard | None = None
) -> dict[str, Any]:
    """Calibrate, solve (rank 0), run every plan; the scenario's results on rank 0."""
    t0 = time.perf_counter()
    mine, cal_tries = _guarded(guard, lambda: _calibrate_here(rank, world, c))
    mine["attempts"] = cal_tries
    cals = _gather(mine)
    t_cal = time.perf_counter() - t0
    _log(rank, f"{label}: calibrated in {t_cal:.1f} s: {[r['measured'] for r in cals]}")
    plans: dict[str, Any] | None = None
    if rank == 0:
        try:
            plans = solve_plans(c, cals)
        except Exception as exc:  # report the failure instead of hanging the other rank
            plans = {"error": f"{type(exc).__name__}: {exc}"}
    plans = _broadcast(plans)
    if "error" in plans:
        return {"label": label, "calibration": cals, "error": plans["error"]}
    runs: dict[str, dict[str, Any]] = {}
    for phase, by_policy in plans.items():
        # Every plan of the phase stays built; rounds alternate between them so slow drift
        # (clocks, host load) affects every policy alike.
        prepared = {
            policy: prepare_plan(rank, world, c, entry["plan"], phase)
            for policy, entry in by_policy.items()
        }
        rounds: dict[str, list[Any]] = {policy: [] for policy in by_policy}
        tries: dict[str, list[int]] = {policy: [] for policy in by_policy}
        for _ in range(c.rounds):
            for policy in by_policy:
                result, n = _guarded(guard, lambda p=prepared[policy]: measure_plan(p, c))
                rounds[policy].append(result)
                tries[policy].append(n)
        runs[phase] = {}
        for policy, entry in by_policy.items():
            mine = summarize(rank, prepared[policy], rounds[policy])
            mine["attempts"] = tries[policy]
            measured = _gather(mine)
            _log(
                rank,
                f"{label} {phase} {policy}: predicted {entry['predicted']['layer_us']:.0f} us, "
                f"measured {max(m['layer_us'] for m in measured):.0f} us",
            )
            runs[phase][policy] = {**entry, "measured": measured}
        del prepared
    return {
        "label": label,
        "calibration_s": t_cal,
        "calibration": cals,
        "runs": runs,
        "duration_s": time.perf_counter() - t0,
    }


def _bench_rank(rank: int, world: int, c: BenchConfig) -> dict[str, Any]:
    """Everything on one rank: equal speed, then GPU 1 slowed."""
    out: dict[str, Any] = {"rank": rank}
    out["equal"] = _scenario(rank, world, c, "equal speed")
    report: dict[str, Any] = {"method": c.slowdown}
    if c.slowdown != "none" and not c.cpu:
        guard = _Guard(c, rank) if rank == 1 else None
        out["slowed"] = _scenario(rank, world, c, f"gpu1 slowed ({c.slowdown})", guard)
        if guard is not None:
            report = {"method": guard.method, "events": guard.events}
    out["slowdown"] = _gather(report)
    return out


# ---------------------------------------------------------------------------------- CLI


def _cpu_setup() -> tuple[dict[str, Any], BenchConfig]:
    """The ``--cpu`` run: the node as NVML discovery reported it on a real 2x H200 host
    (tests/fixtures/nvml/h200x2-discovered.json, which tests/agents/test_nvml.py replays
    against the discovery code) and tiny shapes with made-up calibration effort. Returns
    (discovery record, config)."""
    here = os.path.dirname(os.path.abspath(__file__))
    fixture = os.path.join(here, "..", "..", "tests", "fixtures", "nvml", "h200x2-discovered.json")
    with open(fixture, encoding="utf-8") as fh:
        inv = inventory_from_dict(json.load(fh)["inventory"])
    discovered: dict[str, Any] = {"inventory": inventory_to_dict(inv)}
    c = BenchConfig(
        hidden=256,
        num_experts=16,
        top_k=4,
        expert_ffn=64,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        decode_tokens=8,
        prefill_tokens=32,
        decode_context=16,
        prefill_seq=16,
        redundant_experts=4,
        warmup=1,
        iters=2,
        rounds=2,
        slowdown="none",
        cpu=True,
        calib=replace(
            CalibrationOptions(),
            hidden=256,
            expert_ffn=64,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            num_experts=16,
            top_k=4,
            prefill_seq=16,
            profile_tokens=32,
            profile_decode_tokens=4,
            profile_decode_context=16,
            iters=2,
            fp8_dispatch=False,
        ),
    )
    return discovered, c


def _gpu_setup(args: argparse.Namespace) -> tuple[dict[str, Any], BenchConfig]:
    """The GPU run: NVML discovery of this node (written to ``DIR/discovered.json``) and the
    config from the flags. Returns (discovery record, config)."""
    from agents.discovery.nvml import record_node

    discovered = record_node(node_name="h200-node")
    with open(os.path.join(args.out, "discovered.json"), "w", encoding="utf-8") as fh:
        json.dump(discovered, fh, indent=1)
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    c = BenchConfig(
        slowdown=args.slowdown,
        hog_sms=args.hog_sms,
        iters=args.iters,
        rounds=args.rounds,
        calib=replace(CalibrationOptions(), iters=args.calib_iters, fp8_dispatch=False),
    )
    return discovered, c


def _gpu_problem() -> str:
    """Why this host cannot run the two-GPU measurements ('' when it can)."""
    try:
        import torch
    except ImportError:
        return (
            "the bench needs PyTorch. To fix: pip install -e '.[gpu]' (or run with --cpu "
            "after installing torch)"
        )
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return (
            f"the bench compares plans over two GPUs of one node; this host has {n} visible "
            "CUDA GPU(s). To fix: run on a node with two or more GPUs, check "
            "CUDA_VISIBLE_DEVICES, or run the CPU pipeline with --cpu; one GPU: "
            "python -m bench.gpu --out DIR"
        )
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurements and write ``DIR/gpu-bench.json`` (and the discovery record)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="folder for the results")
    p.add_argument("--cpu", action="store_true", help="tiny CPU run (gloo), made-up figures")
    p.add_argument("--slowdown", default="sm_hog", choices=("sm_hog", "gemm_load", "none"))
    p.add_argument("--hog-sms", type=int, default=88, help="SMs of GPU 1 taken by sm_hog")
    p.add_argument("--iters", type=int, default=8, help="timed steps per plan and round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per phase")
    p.add_argument("--calib-iters", type=int, default=10)
    args = p.parse_args(argv)
    if not args.cpu:
        problem = _gpu_problem()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    discovered, c = _cpu_setup() if args.cpu else _gpu_setup(args)
    c = replace(c, inventory=discovered["inventory"])
    from agents.runtime.launch import spawn

    ranks = spawn(_bench_rank, 2, c, backend="gloo" if args.cpu else "nccl", timeout_s=1200)
    doc = {
        "kind": "mixfleet.gpu-bench/v1",
        "command": "python -m agents.runtime.bench "
        + " ".join(argv or sys.argv[1:]).replace(args.out, "OUT"),
        "environment": environment(),
        "config": {k: v for k, v in asdict(c).items() if k != "inventory"},
        "model": asdict(bench_model(c)),
        "inventory": c.inventory,
        "equal": ranks[0]["equal"],
        "slowed": ranks[0].get("slowed"),
        "slowdown": ranks[0]["slowdown"],
        "duration_s": time.perf_counter() - t0,
    }
    doc["report"] = report(doc)
    path = os.path.join(args.out, "gpu-bench.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, default=str)
    print(summary(doc))
    print(f"wrote {path} in {doc['duration_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
