"""The operator and a ModelDeployment's ``spec.engine``: the engine reaches the solve and its
digest, and examples/k8s/sglang-engine.yaml starts SGLang with the plan's launch recipe - the
operator writes the recipe (policies.launch) into the deployment's ConfigMap, and the
example's pod, given that ConfigMap at its mount path, execs exactly the recipe's command
line and environment. The pod's command is run for real with ``sh`` against a stand-in
``python3`` that records what it was started with."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_builders import deployment, md_spec, node_view, observed, plan_view_from
from test_operator_reconcile import SETTINGS, only, tick

from apis.kube.errors import PermanentError
from apis.kube.names import config_map_name
from apis.kube.plancodec import decode_plan
from operators.decide import ApplyConfigMap, ApplyPlan, SolveAction, reconcile
from operators.inputs import deployment_engine
from operators.objects import ENGINE_FILES, LAUNCH_SCRIPT, MOUNT_DIR, config_map_keys
from policies.estimate.engines import EngineSpec
from policies.hardware.fleet import parse_node
from policies.hardware.inventory import inventory_from_node
from policies.launch import launch_recipe
from policies.model.architecture import preset
from policies.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/k8s/sglang-engine.yaml"
DEPLOYMENT = ROOT / "examples/k8s/modeldeployment-qwen3.yaml"


def _container() -> dict[str, Any]:
    (ds,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = pod["volumes"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["mountPath"] == MOUNT_DIR
    assert volume["configMap"]["name"] == config_map_name("qwen3")
    return dict(container)


def _node(name: str, gpus: int) -> Any:
    doc = {
        "name": name,
        "gpus": [{"model": "H100-SXM5-80GB", "count": gpus}],
        "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
        "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
    }
    return node_view(name, inv=inventory_from_node(parse_node(doc)))


def _published(nodes: list[str], gpus: int) -> tuple[dict[str, str], Plan]:
    """The ConfigMap data the operator writes for the example deployment, and its plan."""
    (doc,) = [d for d in yaml.safe_load_all(DEPLOYMENT.read_text()) if d]
    spec = md_spec(**doc["spec"])
    d = dataclasses.replace(deployment(spec), name="qwen3", namespace="inference")
    actions = tick(observed(d, [_node(n, gpus) for n in nodes]))
    (cm,) = only(actions, ApplyConfigMap)
    assert isinstance(cm, ApplyConfigMap)
    data: dict[str, str] = cm.body["data"]
    assert tuple(sorted(data)) == config_map_keys(spec)
    (body,) = only(actions, ApplyPlan)
    assert isinstance(body, ApplyPlan)
    return data, decode_plan(plan_view_from(body.body).spec)


def _run_pod(container: dict[str, Any], data: dict[str, str], node: str, tmp: Path) -> Any:
    """Run the example container's command on ``node`` with the ConfigMap mounted (at a
    temporary directory standing in for MOUNT_DIR) and a recording ``python3``."""
    mount = tmp / "mount"
    mount.mkdir(parents=True)
    for key, text in data.items():
        (mount / key).write_text(text)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    record = tmp / "started.json"
    stub = bin_dir / "python3"
    stub.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "MIXFLEET_NODE": node}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    argv = [a.replace(MOUNT_DIR, str(mount)) for a in container["command"]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    if not record.exists():
        return done
    return json.loads(record.read_text())


@pytest.mark.parametrize("nodes", [["gpu-a"], ["gpu-a", "gpu-b"]], ids=["1-node", "2-nodes"])
def test_the_example_pod_execs_the_recipe(nodes: list[str], tmp_path: Path) -> None:
    container = _container()
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    data, plan = _published(nodes, gpus)
    env = {e["name"]: e.get("value") for e in container["env"]}
    recipe = launch_recipe(
        plan,
        preset("qwen3-30b-a3b"),
        placement_path=f"{MOUNT_DIR}/{ENGINE_FILES['sglang']}",
        model_path=env["MIXFLEET_MODEL_PATH"],
        dist_init_addr=env["MIXFLEET_DIST_INIT_ADDR"],
    )
    assert container["command"] == ["sh", f"{MOUNT_DIR}/{LAUNCH_SCRIPT}"]
    for n, node in enumerate(nodes):
        started = _run_pod(container, data, node, tmp_path / node)
        launch = recipe.nodes[n]
        assert launch.node == node and launch.rank_range == (n * gpus, (n + 1) * gpus)
        assert ["python3", *started["argv"]] == list(launch.argv)
        for k, v in launch.env.items():
            assert started["env"][k] == v
        assert started["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(str(i) for i in range(gpus))
    flags = dict(zip(launch.argv[3::2], launch.argv[4::2], strict=False))
    assert flags["--init-expert-location"] == f"{MOUNT_DIR}/expert-location.json"
    assert flags["--moe-a2a-backend"] == "deepep" and flags["--ep-dispatch-algorithm"] == "static"
    assert flags["--tp-size"] == flags["--ep-size"] == str(gpus * len(nodes))
    assert flags["--nnodes"] == str(len(nodes))
    assert ("--dist-init-addr" in launch.argv) == (len(nodes) > 1)


def test_a_node_outside_the_plan_refuses_to_start(tmp_path: Path) -> None:
    container = _container()
    data, _ = _published(["gpu-a"], 4)
    done = _run_pod(container, data, "elsewhere", tmp_path)
    assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 1
    assert "node elsewhere is not in plan" in done.stderr


def test_native_deployments_publish_no_recipe() -> None:
    spec = md_spec(model="qwen3-30b-a3b", engineFormat="sglang")
    assert config_map_keys(spec) == ("expert-location.json", "placement-sidecar.json")
    data = only(tick(observed(deployment(spec))), ApplyConfigMap)[0]
    assert isinstance(data, ApplyConfigMap) and LAUNCH_SCRIPT not in data.body["data"]


def test_the_deployment_engine_reaches_the_request_and_its_digest() -> None:
    def solve_of(spec: Any) -> Any:
        (action,) = only(reconcile(observed(deployment(spec)), SETTINGS), SolveAction)
        assert isinstance(action, SolveAction)
        return action

    native = solve_of(md_spec())
    sglang = solve_of(md_spec(model="qwen3-30b-a3b", engine={"name": "sglang"}))
    vllm = solve_of(md_spec(model="qwen3-30b-a3b", engine={"name": "vllm"}, engineFormat="vllm"))
    assert native.request.engine == EngineSpec()
    assert sglang.request.engine == EngineSpec("sglang")
    assert vllm.request.engine == EngineSpec("vllm")
    assert sglang.inputs_digest != vllm.inputs_digest
    with pytest.raises(PermanentError, match=r"spec\.engine\.options\.dispatch"):
        deployment_engine(md_spec(engine={"name": "vllm", "options": {"dispatch": "static"}}))
