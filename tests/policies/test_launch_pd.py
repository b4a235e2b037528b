"""Launch recipes of prefill/decode servers (policies.launch): each engine's disaggregation
flags and KV transfer backend per role, the refusals of a pool whose path the backend cannot
use, and the operator's engine ConfigMap built from the same recipe."""

from __future__ import annotations

import json

import pytest
from launch_builders import QWEN, flags, plan_for

from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.launch import (
    NODE_ADDR_REF,
    TRTLLM_OPTIONS_FILE,
    TRTLLM_SERVER_PORT,
    KvTransfer,
    instance_path,
    launch_recipe,
    path_kind,
    recipe_to_doc,
    shell_word,
    transfer_backend,
    trtllm_disagg_config,
)

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
