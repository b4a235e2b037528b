"""Launch recipes of a fleet plan (policies.launch): every engine instance of a deployment
read from a real FleetPlan document, launched as its role with its own files, and
``mixfleetctl plan launch`` (``--plan`` and ``--fleet-plan``) printing them."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest
from launch_builders import QWEN, flags, fleet, plan_for
from support.planner_settings import COARSE

from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.fleetplan import (
    FleetDeployment,
    MemoryCurveCache,
    PlanRequest,
    plan_fleet,
)
from policies.fleetplan.report import plan_doc
from policies.launch import (
    DeploymentLaunch,
    deployment_launch,
    deployment_launch_to_doc,
    instance_request,
    planned_instances,
)
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.solve import solve
from policies.spec.build import DeploymentSpec, WorkloadSpec

# ------------------------------------------------------------------------- fleet plans

H100X3 = fleet(*((f"h{i}", "H100-SXM5-80GB", 4) for i in range(3)))


@functools.cache
def fleet_plan_doc(engine: str, disaggregation: str) -> tuple[dict[str, Any], DeploymentSpec]:
    """A real FleetPlan document: the planner's answer for one Qwen3-30B deployment on
    three 4-GPU H100 nodes (cached: callers copy before changing it)."""
    spec = DeploymentSpec(
        "q",
        model="qwen3-30b-a3b",
        policy="greedy",
        workload=WorkloadSpec(kv_cache_dtype="fp8"),
        engine=EngineSpec(engine),  # type: ignore[arg-type]
        traffic=Traffic(1000.0, LengthDist(4096, 5120), LengthDist(512, 640)),
        slo=Slo(ttft_ms=2000, tpot_ms=50, percentile=90),
        disaggregation=disaggregation,
    )
    settings = COARSE
    req = PlanRequest(H100X3, (FleetDeployment(spec),), settings=settings)
    got = plan_fleet(req, cache=CACHE)
    return json.loads(json.dumps(plan_doc(got, settings.chunk_tokens))), spec


CACHE = MemoryCurveCache()


def launch_of(doc: dict[str, Any], spec: DeploymentSpec, **kw: Any) -> DeploymentLaunch:
    instances = planned_instances(doc, spec.name)
    plans = [solve(instance_request(spec, H100X3, i)).plan for i in instances]
    return deployment_launch(spec.name, instances, plans, QWEN, **kw)


def test_a_fleet_plans_pd_pool_launches_each_instance_as_its_role() -> None:
    doc, spec = fleet_plan_doc("sglang", "on")
    instances = planned_instances(doc, "q")
    roles = [i.role for i in instances]
    assert set(roles) == {"prefill", "decode"} and roles == sorted(roles, reverse=True)
    assert all(i.kv_path.startswith("RDMA") for i in instances)
    nodes = [n for i in instances for n in i.nodes]
    assert len(nodes) == len(set(nodes))  # each node serves one instance
    launch = launch_of(doc, spec)
    assert launch.engine == "sglang 0.5.23" and len(launch.instances) == len(instances)
    for il in launch.instances:
        r, inst = il.recipe, il.instance
        assert r.role == inst.role and [n.node for n in r.nodes] == list(inst.nodes)
        f = flags(r.nodes[0].argv)
        assert f["--disaggregation-mode"] == inst.role
        assert f["--init-expert-location"] == f"expert-location-{inst.name}.json"
        assert f["--attn-dp-size"] == str(inst.gpus // inst.attention_tp)
    out = deployment_launch_to_doc(launch)
    assert json.loads(json.dumps(out)) == out
    assert [i["role"] for i in out["instances"]] == roles


def test_a_fleet_plans_aggregated_instances_launch_without_disaggregation() -> None:
    doc, spec = fleet_plan_doc("vllm", "off")
    launch = launch_of(doc, spec)
    assert launch.instances and all(i.recipe.role == "aggregated" for i in launch.instances)
    assert not any("--kv-transfer-config" in i.recipe.nodes[0].argv for i in launch.instances)
    assert launch.files == {}


def test_trtllm_pools_get_their_disaggregated_server_yaml() -> None:
    doc, spec = fleet_plan_doc("trtllm", "on")
    launch = launch_of(doc, spec, options_path="/etc/mixfleet/opts.yaml")
    ((path, config),) = launch.files.items()
    assert path == "/etc/mixfleet/disagg-q-0.yaml"
    ctx = [f"{i.instance.nodes[0]}:8000" for i in launch.instances if i.instance.role == "prefill"]
    gen = [f"{i.instance.nodes[0]}:8000" for i in launch.instances if i.instance.role == "decode"]
    assert config["context_servers"] == {"num_instances": len(ctx), "urls": ctx}
    assert config["generation_servers"] == {"num_instances": len(gen), "urls": gen}
    for il in launch.instances:  # each instance reads its own options file
        (opts,) = il.recipe.files
        assert opts == f"/etc/mixfleet/opts-{il.instance.name}.yaml"
        assert flags(il.recipe.nodes[0].argv)["--extra_llm_api_options"] == opts


def test_each_instance_is_placed_at_the_batch_and_context_the_planner_sized() -> None:
    """The planner's batch limit and the KV each sequence reserves, not the deployment's
    default batch: at the default a planned instance can overflow its GPUs' memory."""
    doc, spec = fleet_plan_doc("sglang", "on")
    groups = [g for p in doc["deployments"][0]["pools"] for g in p["instances"]]
    instances = planned_instances(doc, "q")
    assert len(instances) == sum(g["count"] for g in groups)
    for inst in instances:
        (g,) = (g for g in groups if inst.nodes in [tuple(n) for n in g["nodes"]])
        phase = "prefill" if g["role"] == "prefill" else "decode"
        context = 4096 if phase == "prefill" else 4096 + 512
        tokens = max(1, g["batchLimit"] // g["gpus"])
        assert inst.workload == (phase, tokens, context)
        w = instance_request(spec, H100X3, inst).workload
        assert (w.phase, w.tokens_per_gpu, w.context_len) == (phase, tokens, context)
        assert solve(instance_request(spec, H100X3, inst)).plan.summary.feasible
    without = json.loads(json.dumps(doc))
    for p in without["deployments"][0]["pools"]:
        for g in p["instances"]:
            del g["workload"]
    (first, *_) = planned_instances(without, "q")
    assert first.workload is None  # older documents: the deployment's own workload
    bad = json.loads(json.dumps(doc))
    bad["deployments"][0]["pools"][0]["instances"][0]["workload"]["tokensPerGpu"] = 0
    with pytest.raises(InputError) as exc:
        planned_instances(bad, "q")
    assert exc.value.field == "deployments[q].pools[0].instances[0].workload.tokensPerGpu"


def test_fleet_plan_refusals_name_the_field() -> None:
    doc, spec = fleet_plan_doc("sglang", "on")
    with pytest.raises(InputError, match="no deployment 'x'; it has q"):
        planned_instances(doc, "x")
    with pytest.raises(InputError, match="not a FleetPlan document"):
        planned_instances({"kind": "Plan"}, "q")
    broken = json.loads(json.dumps(doc))
    broken["deployments"][0]["pools"][0]["instances"][0]["gpus"] = "four"
    with pytest.raises(InputError) as exc:
        planned_instances(broken, "q")
    assert exc.value.field == "deployments[q].pools[0].instances[0].gpus"
    no_path = json.loads(json.dumps(doc))
    no_path["deployments"][0]["pools"][0]["kvPath"]["path"] = ""
    with pytest.raises(InputError, match="over RDMA or NVLink; the pool's path is 'none'"):
        launch_of(no_path, spec)
    instances = planned_instances(doc, "q")
    plans = [solve(instance_request(spec, H100X3, i)).plan for i in instances]
    with pytest.raises(InputError, match=r"its plan .* is on"):
        deployment_launch("q", instances, plans[::-1], QWEN)
    with pytest.raises(InputError, match="mooncake backend moves KV over RDMA"):
        nv = [dataclasses.replace(i, kv_path="NVLink d") for i in instances]
        deployment_launch("q", nv, plans, QWEN, transfer_backend="mooncake")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    from controlplane.cli import main

    code = main([str(a) for a in argv])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_plan_launch_cli_prints_every_instance_of_a_fleet_plan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # --write-options writes the engine files beside the caller
    doc, _ = fleet_plan_doc("sglang", "on")
    (tmp_path / "fp.json").write_text(json.dumps(doc))
    (tmp_path / "fleet.yaml").write_text(json.dumps(FLEET_DOC))
    (tmp_path / "dep.yaml").write_text(json.dumps(DEP_DOC))
    base: list[str | Path] = ["plan", "launch", "--fleet-plan", tmp_path / "fp.json"]
    base += ["--deployment", "q"]
    base += ["--fleet", tmp_path / "fleet.yaml", "-f", tmp_path / "dep.yaml", "-q"]
    code, out, err = run_cli(capsys, *base, "-o", "json")
    assert code == 0, err
    got = json.loads(out)
    assert {i["role"] for i in got["instances"]} == {"prefill", "decode"}
    for i in got["instances"]:
        argv = i["recipe"]["argv"] if "argv" in i["recipe"] else i["recipe"]["nodes"][0]["argv"]
        assert argv[argv.index("--disaggregation-mode") + 1] == i["role"]
    code, out, err = run_cli(capsys, *base)
    assert code == 0 and "# === instance q-prefill-0: prefill in pool" in out
    assert "--disaggregation-transfer-backend mooncake" in out
    code, out, err = run_cli(capsys, *base, "--transfer-backend", "nixl", "--write-options")
    assert code == 0 and "--disaggregation-transfer-backend nixl" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--deployment", "q"], "error: --deployment: goes with --fleet-plan"),
        (["--role", "prefill"], "error: --kv-path: a prefill server needs its pool's KV path"),
        (["--role", "prefill", "--kv-path", "tcp"], "over RDMA or NVLink; the pool's path"),
        (["--kv-path", "rdma"], "error: --role: --kv-path and --transfer-backend are for a"),
        (["--role", "decode", "--kv-path", "nvlink", "--transfer-backend", "mooncake"], "RDMA"),
    ],
)
def test_plan_launch_cli_refusals_are_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str], needle: str
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan_for(EngineSpec("sglang")).to_dict()))
    code, out, err = run_cli(capsys, "plan", "launch", "--plan", path, *extra)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_plan_launch_cli_role_flags_reach_the_recipe(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan_for(EngineSpec("vllm")).to_dict()))
    code, out, err = run_cli(
        capsys,
        "plan",
        "launch",
        "--plan",
        path,
        "--role",
        "prefill",
        "--kv-path",
        "RDMA ib",
        "-o",
        "json",
        "-q",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["role"] == "prefill" and doc["kv_transfer"] == {"backend": "NixlConnector"}
    argv = doc["nodes"][0]["argv"]
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_role"] == "kv_producer"


FLEET_DOC = {
    "apiVersion": "mixfleet.io/v1alpha1",
    "kind": "Fleet",
    "metadata": {"name": "f"},
    "spec": {
        "nodes": [
            {
                "name": f"h{i}",
                "gpus": [{"model": "H100-SXM5-80GB", "count": 4}],
                "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
                "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib"}],
            }
            for i in range(3)
        ]
    },
}
DEP_DOC = {
    "apiVersion": "mixfleet.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "q"},
    "spec": {
        "model": "qwen3-30b-a3b",
        "policy": "greedy",
        "engine": {"name": "sglang"},
        "workload": {"kvCacheDtype": "fp8"},
        "traffic": {
            "requestsPerS": 1000,
            "inputTokens": {"mean": 4096, "p90": 5120},
            "outputTokens": {"mean": 512, "p90": 640},
        },
        "slo": {"ttftMs": 2000, "tpotMs": 50, "percentile": 90},
        "disaggregation": "on",
    },
}
