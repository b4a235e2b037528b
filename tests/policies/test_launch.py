"""Launch recipes (policies.launch): per node, in rank order, the flags of SGLang 0.5.23,
vLLM 0.33.0 and TensorRT-LLM that run a plan as it was predicted, and the refusals. The
rendered ``sh`` commands are run through a real shell against a recording stand-in."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

from policies.engines import EngineOptions, EngineSpec
from policies.errors import InputError
from policies.exports import VLLM_NO_REBALANCE_STEP_INTERVAL as NEVER
from policies.fleet import Fleet, parse_fleet
from policies.fleetplan import (
    CurveGrid,
    FleetDeployment,
    MemoryCurveCache,
    PlannerSettings,
    PlanRequest,
    plan_fleet,
)
from policies.fleetplan.report import plan_doc
from policies.launch import (
    MODEL_PATH_REF,
    NODE_ADDR_REF,
    TRTLLM_OPTIONS_FILE,
    TRTLLM_SERVER_PORT,
    DeploymentLaunch,
    KvTransfer,
    LaunchRecipe,
    NodeLaunch,
    deployment_launch,
    deployment_launch_to_doc,
    instance_path,
    instance_request,
    launch_recipe,
    launch_script,
    node_command,
    path_kind,
    planned_instances,
    recipe_to_doc,
    shell_word,
    transfer_backend,
    trtllm_disagg_config,
    vllm_default_rows,
)
from policies.models import ModelSpec, preset
from policies.plan import ExpertSlot, Plan
from policies.request import PlacementRequest
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.solve import solve
from policies.spec import DeploymentSpec, WorkloadSpec
from policies.workload import make_workload

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


# ----------------------------------------------------------------------------- SGLang


def test_sglang_runs_every_node_with_the_plans_shape_backend_and_placement() -> None:
    plan = plan_for(EngineSpec("sglang"))
    r = launch_recipe(plan, QWEN, model_path="/models/qwen", dist_init_addr="10.0.0.1:5000")
    assert r.engine == "sglang 0.5.23"
    assert [(n.node, n.node_rank, n.rank_range) for n in r.nodes] == [
        ("h0", 0, (0, 2)),
        ("h1", 1, (2, 4)),
    ]
    for i, n in enumerate(r.nodes):
        assert n.argv[:3] == ("python3", "-m", "sglang.launch_server")
        assert flags(n.argv) == {
            "--model-path": "/models/qwen",
            "--tp-size": "4",
            "--attn-dp-size": "4",
            "--ep-size": "4",
            "--moe-a2a-backend": "deepep",
            "--ep-num-redundant-experts": str(plan.num_redundant),
            "--init-expert-location": "expert-location.json",
            "--ep-dispatch-algorithm": "static",
            "--nnodes": "2",
            "--node-rank": str(i),
            "--dist-init-addr": "10.0.0.1:5000",
        }
        assert n.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
        assert "--enable-eplb" not in n.argv


def test_sglang_dispatch_flag_follows_the_plans_replica_rule() -> None:
    dynamic = plan_for(EngineSpec("sglang", options=EngineOptions(dispatch="dynamic")))
    assert flags(launch_recipe(dynamic, QWEN).nodes[0].argv)["--ep-dispatch-algorithm"] == (
        "dynamic"
    )
    none = plan_for(EngineSpec("sglang", options=EngineOptions(a2a_backend="none")))
    argv = launch_recipe(none, QWEN).nodes[0].argv
    assert flags(argv)["--moe-a2a-backend"] == "none"
    assert "--ep-dispatch-algorithm" not in argv  # SGLang then splits evenly, as planned


def test_one_node_needs_no_rendezvous_and_gpu_indices_come_from_the_ids() -> None:
    plan = plan_for(EngineSpec("sglang"), fleet(("solo", "H100-SXM5-80GB", 4)))
    (node,) = launch_recipe(plan, QWEN).nodes
    assert "--dist-init-addr" not in node.argv
    assert flags(node.argv)["--model-path"] == MODEL_PATH_REF
    assert flags(node.argv)["--nnodes"] == "1"
    # Ranks follow the plan's GPU order; the indices are those of the GPU ids.
    relabelled = dataclasses.replace(
        plan,
        gpus=tuple(dataclasses.replace(g, gpu=f"solo/gpu{7 - i}") for i, g in enumerate(plan.gpus)),
    )
    (node,) = launch_recipe(relabelled, QWEN).nodes
    assert node.env["CUDA_VISIBLE_DEVICES"] == "7,6,5,4"


# ------------------------------------------------------------------------------- vLLM


def test_vllm_nodes_share_the_dp_group_and_eplb_never_rebalances() -> None:
    plan = plan_for(EngineSpec("vllm"))
    assert plan.num_redundant > 0
    r = launch_recipe(plan, QWEN, model_path="m", dist_init_addr="head:13345")
    first, second = (flags(n.argv) for n in r.nodes)
    assert r.nodes[0].argv[:3] == ("vllm", "serve", "m")
    assert first["--tensor-parallel-size"] == "1" and first["--data-parallel-size"] == "4"
    assert first["--enable-expert-parallel"] == ""
    assert first["--all2all-backend"] == plan.engine.a2a_backend
    assert first["--data-parallel-size-local"] == second["--data-parallel-size-local"] == "2"
    assert (first["--data-parallel-start-rank"], second["--data-parallel-start-rank"]) == (
        "0",
        "2",
    )
    assert first["--data-parallel-address"] == "head"
    assert first["--data-parallel-rpc-port"] == "13345"
    assert "--headless" not in r.nodes[0].argv and r.nodes[1].argv[-1] == "--headless"
    eplb = json.loads(first["--eplb-config"])
    assert eplb == {
        "num_redundant_experts": plan.num_redundant,
        "step_interval": NEVER,
    }
    # vLLM's EplbState starts at 3/4 of the interval: the first rebalance is this far away.
    assert NEVER - (NEVER - NEVER // 4) > 10**17
    assert any("no flag reads eplb-state.json" in n for n in r.notes)


def test_vllm_without_redundant_slots_still_gets_its_eplb_state() -> None:
    """R = 0 (the automatic choice on several fleets): a placement other than vLLM's default
    layout is installed through EplbState, which vLLM creates only with --enable-eplb."""
    plan = plan_for(EngineSpec("vllm"), redundant=0)
    assert plan.num_redundant == 0
    rows = plan.physical_to_logical()
    assert any(row != vllm_default_rows(plan.num_experts, len(row)) for row in rows)
    r = launch_recipe(plan, QWEN)
    for n in r.nodes:
        assert "--enable-eplb" in n.argv
        eplb = json.loads(flags(n.argv)["--eplb-config"])
        assert eplb == {"num_redundant_experts": 0, "step_interval": NEVER}
    assert any("EplbState" in note for note in r.notes)


def test_vllm_says_when_the_plan_is_its_default_layout() -> None:
    plan = plan_for(EngineSpec("vllm"), redundant=0)
    e, slots = plan.num_experts, plan.slots_per_gpu
    assert slots is not None
    default = vllm_default_rows(e, e)
    assert default == list(range(e))
    gpus = tuple(
        dataclasses.replace(
            g,
            experts=tuple(
                tuple(ExpertSlot(p, 1.0) for p in default[i * slots : (i + 1) * slots])
                for _ in plan.moe_layers
            ),
        )
        for i, g in enumerate(plan.gpus)
    )
    r = launch_recipe(dataclasses.replace(plan, gpus=gpus), QWEN)
    assert any("is vLLM's default layout" in n for n in r.notes)
    assert "--enable-eplb" not in r.nodes[0].argv  # no redundant slots: EPLB not needed
    refs = flags(r.nodes[0].argv)
    assert refs["--data-parallel-address"] == "${MIXFLEET_DIST_INIT_ADDR%:*}"


def test_vllm_rejects_a_malformed_address() -> None:
    with pytest.raises(InputError, match="HOST:PORT"):
        launch_recipe(plan_for(EngineSpec("vllm")), QWEN, dist_init_addr="head")


# ------------------------------------------------------------------------ TensorRT-LLM


def test_trtllm_reads_the_load_balancer_through_its_options_file() -> None:
    plan = plan_for(EngineSpec("trtllm"))
    r = launch_recipe(plan, QWEN, placement_path="/p/lb.yaml", options_path="/p/opts.yaml")
    assert r.files == {
        "/p/opts.yaml": {
            "enable_attention_dp": True,
            "moe_expert_parallel_size": 4,
            "moe_config": {"backend": "WIDEEP", "load_balancer": "/p/lb.yaml"},
        }
    }
    for n in r.nodes:
        assert n.argv[:2] == ("trtllm-llmapi-launch", "trtllm-serve")
        assert flags(n.argv) == {
            "--backend": "pytorch",
            "--tp_size": "4",
            "--ep_size": "4",
            "--gpus_per_node": "2",
            "--extra_llm_api_options": "/p/opts.yaml",
        }
        assert n.env["TRTLLM_FORCE_ALLTOALL_METHOD"] == "DeepEP"
    assert any("one MPI job" in note and "h0:2,h1:2" in note for note in r.notes)
    single = plan_for(EngineSpec("trtllm"), fleet(("solo", "A100-SXM4-80GB", 4)))
    (node,) = launch_recipe(single, QWEN).nodes
    assert node.argv[0] == "trtllm-serve"
    assert node.env["TRTLLM_FORCE_ALLTOALL_METHOD"] == "NotEnabled"  # all-gather, as planned


def test_trtllm_refuses_unequal_nodes() -> None:
    f = fleet(("big", "H100-SXM5-80GB", 4), ("small", "H100-SXM5-80GB", 2))
    plan = plan_for(EngineSpec("trtllm"), f, redundant=4)
    with pytest.raises(InputError, match="same number of GPUs"):
        launch_recipe(plan, QWEN)


# --------------------------------------------------------------------------- refusals


def test_refusals_name_what_to_fix() -> None:
    plan = plan_for(EngineSpec("sglang"))
    cases: list[tuple[Plan, ModelSpec, dict[str, Any], str]] = [
        (dataclasses.replace(plan, violations=("h0/gpu0: out of memory",)), QWEN, {}, "infeasible"),
        (plan, QWEN, {"engine": "vllm"}, "solved for sglang, not vllm"),
        (plan_for(EngineSpec()), QWEN, {}, "native (idealised"),
        (plan, MIXTRAL, {}, "is for model qwen3-30b-a3b"),
        (plan, QWEN, {"placement_path": "placement.yaml"}, "ends in .json or .pt"),
    ]
    vllm_mixtral = plan_for(EngineSpec("vllm"), model=MIXTRAL, redundant=0)
    as_sglang = dataclasses.replace(
        vllm_mixtral, engine=dataclasses.replace(vllm_mixtral.engine, name="sglang")
    )
    cases.append((as_sglang, MIXTRAL, {}, "cannot load an expert placement for mixtral-8x7b"))
    for p, model, kw, needle in cases:
        with pytest.raises(InputError, match=re.escape(needle)):
            launch_recipe(p, model, **kw)


def test_a_node_whose_ranks_are_split_is_refused() -> None:
    plan = plan_for(EngineSpec("vllm"))
    a0, a1, b0, b1 = plan.gpus
    with pytest.raises(InputError, match="h0's ranks are not contiguous"):
        launch_recipe(dataclasses.replace(plan, gpus=(a0, b0, a1, b1)), QWEN)


def test_another_version_is_noted() -> None:
    plan = plan_for(EngineSpec("sglang", "0.5.22"))
    notes = launch_recipe(plan, QWEN).notes
    assert notes[0] == "the flags are sglang 0.5.23's; the plan names 0.5.22"


# -------------------------------------------------------------------------- rendering


def test_shell_words_expand_only_the_references() -> None:
    assert shell_word(MODEL_PATH_REF) == '"${MIXFLEET_MODEL_PATH}"'
    assert shell_word("${MIXFLEET_DIST_INIT_ADDR##*:}") == '"${MIXFLEET_DIST_INIT_ADDR##*:}"'
    assert shell_word("/m/$(rm -rf x) ${HOME}") == "'/m/$(rm -rf x) ${HOME}'"
    assert shell_word("plain") == "plain"


def _recorder(tmp: Path, name: str) -> tuple[Path, Path]:
    bin_dir, record = tmp / "bin", tmp / "started.json"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / name
    stub.write_text(
        f"#!{sys.executable}\nimport json, os, sys\njson.dump({{'argv': sys.argv[1:], "
        f"'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    stub.chmod(0o755)
    return bin_dir, record


def test_rendered_commands_start_exactly_the_recipe(tmp_path: Path) -> None:
    plan = plan_for(EngineSpec("vllm"))
    recipe = launch_recipe(plan, QWEN, model_path="/models/it's here")
    bin_dir, record = _recorder(tmp_path, "vllm")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "MIXFLEET_DIST_INIT_ADDR": "10.1.2.3:4567"}
    shell = {"${MIXFLEET_DIST_INIT_ADDR%:*}": "10.1.2.3", "${MIXFLEET_DIST_INIT_ADDR##*:}": "4567"}
    for n in recipe.nodes:
        subprocess.run(["sh", "-c", node_command(n)], env=env, check=True, timeout=30)
        started = json.loads(record.read_text())
        assert started["argv"] == [shell.get(a, a) for a in n.argv[1:]]
        assert started["env"]["CUDA_VISIBLE_DEVICES"] == n.env["CUDA_VISIBLE_DEVICES"]
    script = tmp_path / "launch.sh"
    script.write_text(launch_script(recipe))
    for n in recipe.nodes:
        run_env = {**env, "MIXFLEET_NODE": n.node}
        subprocess.run(["sh", str(script)], env=run_env, check=True, timeout=30)
        assert json.loads(record.read_text())["argv"][:2] == ["serve", "/models/it's here"]
    missing = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and "set MIXFLEET_NODE" in missing.stderr


def test_recipe_document_is_plain_json() -> None:
    recipe = LaunchRecipe(
        "p1", "sglang 0.5.23", (NodeLaunch("n", 0, (0, 2), ("python3",), {"A": "1"}),)
    )
    doc = recipe_to_doc(recipe)
    assert json.loads(json.dumps(doc)) == {
        "plan_id": "p1",
        "engine": "sglang 0.5.23",
        "role": "aggregated",
        "nodes": [
            {"node": "n", "node_rank": 0, "ranks": [0, 2], "argv": ["python3"], "env": {"A": "1"}}
        ],
        "files": {},
        "notes": [],
    }


@pytest.mark.parametrize(
    ("engine", "field"),
    [("sglang", "routed_dp_rank"), ("vllm", "X-data-parallel-rank")],
)
def test_the_dp_note_names_only_the_rank_field_the_engine_reads(
    engine: Literal["sglang", "vllm"], field: str
) -> None:
    plan = plan_for(EngineSpec(engine, options=EngineOptions(dp_balance="router")))
    assert plan.engine.dp_balance == "router"
    note = next(n for n in launch_recipe(plan, QWEN).notes if n.startswith("DP attention"))
    assert field in note
    assert "TensorRT-LLM" not in note and "data_parallel_rank" not in note


# ------------------------------------------------------------------ prefill / decode roles

RDMA = KvTransfer("RDMA ib")
NVLINK = KvTransfer("NVLink nvl0")


def test_sglang_prefill_and_decode_servers_name_their_mode_backend_and_bootstrap() -> None:
    plan = plan_for(EngineSpec("sglang"))
    pre = launch_recipe(plan, QWEN, role="prefill", kv=KvTransfer("RDMA ib", bootstrap_port=9100))
    dec = launch_recipe(plan, QWEN, role="decode", kv=RDMA)
    assert (pre.role, pre.transfer_backend, pre.bootstrap_port) == ("prefill", "mooncake", 9100)
    assert (dec.role, dec.transfer_backend, dec.bootstrap_port) == ("decode", "mooncake", None)
    for n in pre.nodes:
        f = flags(n.argv)
        assert f["--disaggregation-mode"] == "prefill"
        assert f["--disaggregation-transfer-backend"] == "mooncake"
        assert f["--disaggregation-bootstrap-port"] == "9100"
        assert f["--attn-dp-size"] == "4"  # DP attention on: the plan routes 4 DP ranks
    for n in dec.nodes:
        f = flags(n.argv)
        assert f["--disaggregation-mode"] == "decode"
        assert "--disaggregation-bootstrap-port" not in f
    # The aggregated recipe is what it was: no disaggregation flag at all.
    agg = launch_recipe(plan, QWEN)
    assert not any(t.startswith("--disaggregation") for n in agg.nodes for t in n.argv)
    assert any("disagg_prefill_dp_rank" in note for note in pre.notes)
    doc = recipe_to_doc(pre)
    assert doc["role"] == "prefill"
    assert doc["kv_transfer"] == {"backend": "mooncake", "bootstrap_port": 9100}
    assert "kv_transfer" not in recipe_to_doc(agg)


def test_sglang_mooncake_needs_rdma_and_nixl_runs_over_nvlink() -> None:
    plan = plan_for(EngineSpec("sglang"))
    nv = launch_recipe(plan, QWEN, role="decode", kv=NVLINK)
    assert nv.transfer_backend == "nixl"  # the default over NVLink: mooncake needs RDMA
    with pytest.raises(InputError) as exc:
        launch_recipe(plan, QWEN, role="prefill", kv=KvTransfer("NVLink nvl0", "mooncake"))
    msg = str(exc.value)
    assert "mooncake backend moves KV over RDMA" in msg and "To fix: use nixl" in msg
    assert exc.value.field == "transfer-backend"
    with pytest.raises(InputError, match="over RDMA or NVLink; the pool's path is 'none'"):
        launch_recipe(plan, QWEN, role="prefill", kv=KvTransfer(""))
    with pytest.raises(InputError, match="no KV transfer backend 'ucx'"):
        launch_recipe(plan, QWEN, role="prefill", kv=KvTransfer("rdma", "ucx"))
    with pytest.raises(InputError, match="needs its pool's KV path"):
        launch_recipe(plan, QWEN, role="decode")
    with pytest.raises(InputError, match="role 'both' is not one of aggregated, prefill"):
        launch_recipe(plan, QWEN, role="both")
    with pytest.raises(InputError, match="bootstrap port 70000 is not a TCP port"):
        launch_recipe(plan, QWEN, role="prefill", kv=KvTransfer("rdma", bootstrap_port=70000))


def test_path_kind_reads_the_planners_words() -> None:
    assert [path_kind(p) for p in ("RDMA ib0", "RDMA a-b", "NVLink nvl72-0", "rdma", "")] == [
        "rdma",
        "rdma",
        "nvlink",
        "rdma",
        "",
    ]
    assert path_kind("TCP eth0") == ""
    assert transfer_backend("vllm", KvTransfer("NVLink d")) == "NixlConnector"
    assert transfer_backend("trtllm", KvTransfer("RDMA ib")) == "UCX"
    with pytest.raises(InputError, match="MooncakeConnector backend moves KV over RDMA"):
        transfer_backend("vllm", KvTransfer("NVLink d", "MooncakeConnector"))


def test_vllm_pd_servers_carry_their_kv_transfer_config() -> None:
    plan = plan_for(EngineSpec("vllm"))
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        r = launch_recipe(plan, QWEN, role=role, kv=RDMA, dist_init_addr="head:1")
        assert r.transfer_backend == "NixlConnector"
        for n in r.nodes:
            config = json.loads(flags(n.argv)["--kv-transfer-config"])
            assert config == {"kv_connector": "NixlConnector", "kv_role": kv_role}
            assert n.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == NODE_ADDR_REF
            assert shell_word(n.env["VLLM_NIXL_SIDE_CHANNEL_HOST"]) == f'"{NODE_ADDR_REF}"'
        assert any("kv_transfer_params" in note for note in r.notes)
    moon = launch_recipe(plan, QWEN, role="decode", kv=KvTransfer("rdma", "MooncakeConnector"))
    config = json.loads(flags(moon.nodes[0].argv)["--kv-transfer-config"])
    assert config["kv_connector"] == "MooncakeConnector"
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in moon.nodes[0].env
    assert "--kv-transfer-config" not in launch_recipe(plan, QWEN).nodes[0].argv


def test_trtllm_pd_servers_get_the_cache_transceiver_and_listen_for_the_disagg_server() -> None:
    plan = plan_for(EngineSpec("trtllm"))
    pre = launch_recipe(plan, QWEN, role="prefill", kv=RDMA, options_path="/o/ctx.yaml")
    dec = launch_recipe(plan, QWEN, role="decode", kv=KvTransfer("rdma", "NIXL"))
    ctx_opts, gen_opts = pre.files["/o/ctx.yaml"], dec.files[TRTLLM_OPTIONS_FILE]
    assert ctx_opts["cache_transceiver_config"] == {"backend": "UCX"}
    assert ctx_opts["disable_overlap_scheduler"] is True
    assert gen_opts["cache_transceiver_config"] == {"backend": "NIXL"}
    assert "disable_overlap_scheduler" not in gen_opts
    assert ctx_opts["enable_attention_dp"] is True and "moe_config" in ctx_opts
    for r in (pre, dec):
        f = flags(r.nodes[0].argv)
        assert f["--host"] == "0.0.0.0" and f["--port"] == str(TRTLLM_SERVER_PORT)
    agg = launch_recipe(plan, QWEN)
    assert "--port" not in agg.nodes[0].argv
    assert "cache_transceiver_config" not in agg.files[TRTLLM_OPTIONS_FILE]


def test_trtllm_disagg_config_lists_the_pools_servers() -> None:
    doc = trtllm_disagg_config(["h1:8000", "h2:8000"], ["h0:8000"])
    assert doc == {
        "hostname": "0.0.0.0",
        "port": 8000,
        "backend": "pytorch",
        "context_servers": {"num_instances": 2, "urls": ["h1:8000", "h2:8000"]},
        "generation_servers": {"num_instances": 1, "urls": ["h0:8000"]},
    }
    with pytest.raises(InputError, match="needs a context and a generation server"):
        trtllm_disagg_config([], ["h0:8000"])
    with pytest.raises(InputError, match="is not HOST:PORT"):
        trtllm_disagg_config(["h1"], ["h0:8000"])


def test_instance_paths_keep_the_suffix_the_engine_needs() -> None:
    assert instance_path("/etc/mixfleet/expert-location.json", "d-prefill-0") == (
        "/etc/mixfleet/expert-location-d-prefill-0.json"
    )
    assert instance_path("opts.yaml", "d-decode-1") == "opts-d-decode-1.yaml"
    assert instance_path("/p/noext", "x") == "/p/noext-x"


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
    settings = PlannerSettings(
        grid=CurveGrid(
            batch_per_gpu=(1, 8, 32, 128),
            context_tokens=(1024, 8192),
            prefill_per_gpu=(64, 1024, 8192),
        )
    )
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


def test_the_operators_config_map_carries_an_instances_role() -> None:
    """The operator's engine ConfigMap is built by the one recipe builder: a prefill
    instance's ``launch.sh``/``launch.json`` name its role; a pool whose path its backend
    cannot use gets a ``launch.sh`` that refuses to start, saying why."""
    from apis.kube.schema import from_wire
    from apis.kube.v1alpha1 import ModelDeploymentSpec
    from operators.objects import LAUNCH_FILE, LAUNCH_SCRIPT, MOUNT_DIR, launch_data

    spec = from_wire(
        ModelDeploymentSpec,
        {
            "model": "qwen3-30b-a3b",
            "engineFormat": "sglang",
            "engine": {"name": "sglang"},
            "workload": {"phase": "decode", "tokensPerGpu": 32, "contextLen": 2048},
        },
        "spec",
    )
    plan = plan_for(EngineSpec("sglang"))
    data = launch_data(plan, spec, "q", role="prefill", kv=RDMA)
    doc = json.loads(data[LAUNCH_FILE])
    assert doc["role"] == "prefill" and doc["kv_transfer"]["backend"] == "mooncake"
    argv = doc["nodes"][0]["argv"]
    assert argv[argv.index("--disaggregation-mode") + 1] == "prefill"
    assert argv[argv.index("--init-expert-location") + 1] == f"{MOUNT_DIR}/expert-location.json"
    assert "--disaggregation-mode prefill" in data[LAUNCH_SCRIPT]
    refused = launch_data(plan, spec, "q", role="decode", kv=KvTransfer("NVLink d", "mooncake"))
    assert "mooncake backend moves KV over RDMA" in json.loads(refused[LAUNCH_FILE])["error"]
    assert "exit 1" in refused[LAUNCH_SCRIPT]
    assert "--disaggregation-mode" not in json.dumps(launch_data(plan, spec, "q"))
