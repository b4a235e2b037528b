"""Launch recipes (policies.launch): per node, in rank order, the flags of SGLang 0.5.23,
vLLM 0.33.0 and TensorRT-LLM that run an aggregated plan as it was predicted, and the
refusals. The rendered ``sh`` commands are run through a real shell against a recording
stand-in. Prefill/decode servers: test_launch_pd.py; fleet plans: test_launch_fleet.py."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
from launch_builders import MIXTRAL, QWEN, flags, fleet, plan_for

from policies.errors import InputError
from policies.estimate.engines import EngineOptions, EngineSpec
from policies.exports.engine import VLLM_NO_REBALANCE_STEP_INTERVAL as NEVER
from policies.launch import (
    MODEL_PATH_REF,
    LaunchRecipe,
    NodeLaunch,
    launch_recipe,
    launch_script,
    node_command,
    recipe_to_doc,
    shell_word,
    vllm_default_rows,
)
from policies.model.architecture import ModelSpec
from policies.plan import ExpertSlot, Plan

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
