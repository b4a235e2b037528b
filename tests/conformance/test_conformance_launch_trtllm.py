"""TensorRT-LLM's disaggregated serving reads mixfleet's prefill/decode recipes as planned.

TensorRT-LLM cannot be imported on a CPU machine (its Python imports its CUDA bindings and
``tensorrt_llm/llmapi/disagg_utils.py`` imports ``mpi4py`` at the top), so this module checks
the recipes against a FAITHFUL TRANSCRIPTION of the code that reads them, from the
NVIDIA/TensorRT-LLM source (main, late 2026):

* ``tensorrt_llm/llmapi/disagg_utils.py`` - ``extract_disagg_cfg`` (top-level keys inherited
  into both server sections, a key given twice with different values refused) and
  ``extract_ctx_gen_cfgs`` (``urls`` split at ``:`` into hostname and integer port, their
  count equal to ``num_instances``), ``get_server_configs_dict`` (no URL twice for one type);
  what ``trtllm-serve disaggregated -c FILE`` does with the YAML;
* ``tensorrt_llm/llmapi/llm_args.py`` - ``CacheTransceiverConfig(StrictBaseModel)``
  (extra fields forbidden; ``backend: Optional[Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE",
  "MPI"]]``, ``transceiver_runtime``, ``max_tokens_in_buffer``, ``kv_transfer_timeout_ms``,
  ``kv_transfer_sender_future_timeout_ms``) and the LLM-args fields the options YAML sets
  (``enable_attention_dp``, ``moe_expert_parallel_size``, ``moe_config``,
  ``cache_transceiver_config``, ``disable_overlap_scheduler``; extra fields forbidden);
* ``tensorrt_llm/commands/serve.py`` - the ``trtllm-serve`` click options a recipe passes
  (``--host`` default ``localhost``, ``--port`` default 8000, ``--backend``,
  ``--tensor_parallel_size/--tp_size``, ``--moe_expert_parallel_size/--ep_size``,
  ``--gpus_per_node``, ``--config/--extra_llm_api_options``), transcribed as an argparse
  parser with the same names, types and defaults.

When the source changes, this transcription must be re-read against it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import yaml
from conformance.plans import H100, fleet_of
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from controlplane.cli.files import dump_document
from policies.deployment import sub_fleet
from policies.estimate.engines import EngineSpec
from policies.estimate.workload import make_workload
from policies.hardware.fleet import Fleet
from policies.launch import (
    TRANSFER_BACKENDS,
    TRTLLM_SERVER_PORT,
    KvTransfer,
    deployment_launch,
    launch_recipe,
    planned_instances,
    trtllm_disagg_config,
)
from policies.model.architecture import preset
from policies.request import PlacementRequest
from policies.solve import solve

pytestmark = pytest.mark.conformance

QWEN = preset("qwen3-30b-a3b")

# ------------------------------------------------------------- the transcription


@dataclass
class CtxGenServerConfig:
    """disagg_utils.py ``CtxGenServerConfig``."""

    type: Literal["ctx", "gen"]
    hostname: str | None = None
    port: int | None = None
    instance_num_ranks: int = 1
    other_args: dict[str, Any] = field(default_factory=dict)


def extract_ctx_gen_cfgs(
    type: Literal["ctx", "gen"],  # the source's name
    num_instances: int = 1,
    urls: list[str] | None = None,
    **kwargs: Any,
) -> list[CtxGenServerConfig]:
    """disagg_utils.py ``extract_ctx_gen_cfgs``."""
    hostnames: list[str | None] = []
    ports: list[int | None] = []
    if urls:
        for url in urls:
            hostname, port_str = url.split(":")
            hostnames.append(hostname)
            ports.append(int(port_str))
        if len(hostnames) != num_instances:
            raise ValueError(
                f"Number of hostnames ({len(hostnames)}) should be equal to the number of "
                f"instances ({num_instances})"
            )
    else:
        hostnames = [None] * num_instances
        ports = [None] * num_instances
    ranks = (
        kwargs.get("tensor_parallel_size", 1)
        * kwargs.get("pipeline_parallel_size", 1)
        * kwargs.get("context_parallel_size", 1)
    )
    return [
        CtxGenServerConfig(type, h, p, ranks, kwargs) for h, p in zip(hostnames, ports, strict=True)
    ]


def extract_disagg_cfg(
    hostname: str = "localhost",
    port: int = 8000,
    context_servers: dict[str, Any] | None = None,
    generation_servers: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[str, int, list[CtxGenServerConfig]]:
    """disagg_utils.py ``extract_disagg_cfg`` (the part without a cluster or router)."""
    context_servers = context_servers or {}
    generation_servers = generation_servers or {}
    for key, value in kwargs.items():
        for name, servers in (
            ("context_servers", context_servers),
            ("generation_servers", generation_servers),
        ):
            if key in servers:
                if servers[key] != value:
                    raise ValueError(
                        f"Parameter {key} is specified both in the top-level and in the {name} "
                        "section, but with different values"
                    )
            else:
                servers[key] = value
    configs = extract_ctx_gen_cfgs("ctx", **context_servers) + extract_ctx_gen_cfgs(
        "gen", **generation_servers
    )
    seen: dict[tuple[str | None, int | None], CtxGenServerConfig] = {}
    for cfg in configs:  # get_server_configs_dict
        url = (cfg.hostname, cfg.port)
        if url in seen and seen[url].type == cfg.type:
            raise ValueError(f"Duplicated {cfg.type} server config for {url}")
        seen.setdefault(url, cfg)
    return hostname, port, configs


class CacheTransceiverConfig(BaseModel):
    """llm_args.py ``CacheTransceiverConfig(StrictBaseModel)``."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"] | None = None
    transceiver_runtime: Literal["CPP", "PYTHON"] | None = None
    max_tokens_in_buffer: int | None = None
    kv_transfer_timeout_ms: PositiveInt | None = None
    kv_transfer_sender_future_timeout_ms: PositiveInt | None = 1000


class OptionsYaml(BaseModel):
    """The LLM-args fields (llm_args.py ``BaseLlmArgs`` / ``TorchLlmArgs``, extra forbidden)
    that mixfleet's options YAML sets; ``moe_config`` is checked by the load-balancer
    conformance test."""

    model_config = ConfigDict(extra="forbid")

    enable_attention_dp: bool = False
    moe_expert_parallel_size: int | None = None
    moe_config: dict[str, Any] | None = None
    cache_transceiver_config: CacheTransceiverConfig | None = None
    disable_overlap_scheduler: bool = False


def serve_parser() -> argparse.ArgumentParser:
    """serve.py's ``trtllm-serve`` options a recipe passes (names, types, defaults)."""
    p = argparse.ArgumentParser(prog="trtllm-serve", allow_abbrev=False)
    p.add_argument("model")
    p.add_argument("--host", type=str, default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=["pytorch", "tensorrt", "_autodeploy"], default="pytorch")
    p.add_argument("--tensor_parallel_size", "--tp_size", type=int, default=1)
    p.add_argument("--moe_expert_parallel_size", "--ep_size", type=int, default=None)
    p.add_argument("--gpus_per_node", type=int, default=None)
    p.add_argument("--config", "--extra_llm_api_options", dest="extra_llm_api_options")
    return p


# ------------------------------------------------------------------------ tests


def fleet(nodes: int) -> Fleet:
    return fleet_of("trt", [(f"n{i}", H100, 4) for i in range(nodes)])


def plan_on(f: Fleet) -> Any:
    workload = make_workload(QWEN, phase="decode", tokens_per_gpu=32, context_len=2048)
    req = PlacementRequest(
        f, QWEN, workload, policy="greedy", redundant_experts=4, engine=EngineSpec("trtllm")
    )
    plan = solve(req).plan
    assert not plan.violations
    return plan


@pytest.mark.parametrize(("role", "backend"), [("prefill", "UCX"), ("decode", "NIXL")])
def test_server_commands_and_options_parse_as_trtllm_reads_them(role: str, backend: str) -> None:
    plan = plan_on(fleet(1))
    r = launch_recipe(plan, QWEN, role=role, kv=KvTransfer("RDMA ib0", backend))
    ((path, options),) = r.files.items()
    argv = r.nodes[0].argv
    assert argv[0] == "trtllm-serve"
    ns = serve_parser().parse_args(list(argv[1:]))
    assert (ns.host, ns.port) == ("0.0.0.0", TRTLLM_SERVER_PORT)
    assert ns.tensor_parallel_size == ns.moe_expert_parallel_size == len(plan.gpus)
    assert ns.extra_llm_api_options == path
    # the YAML on disk, as trtllm-serve loads it (yaml.safe_load) into the LLM args
    opts = OptionsYaml(**yaml.safe_load(dump_document(options, "yaml")))
    assert opts.enable_attention_dp is True
    assert opts.cache_transceiver_config is not None
    assert opts.cache_transceiver_config.backend == backend
    assert opts.disable_overlap_scheduler is (role == "prefill")


def test_every_backend_mixfleet_names_is_one_trtllm_accepts() -> None:
    for backend in TRANSFER_BACKENDS["trtllm"]:
        assert CacheTransceiverConfig(backend=backend).backend == backend  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        CacheTransceiverConfig(backend="ucx")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        OptionsYaml(cache_transceiver_config={"backend": "UCX"}, kv_role="kv_producer")  # type: ignore[call-arg,arg-type]


def test_the_disaggregated_server_yaml_names_every_server_of_the_pool() -> None:
    """A fleet plan's pool: its YAML parses to one ctx config per prefill instance and one
    gen config per decode instance, at the host and port each server listens on."""
    f = fleet(3)
    doc = {
        "kind": "FleetPlan",
        "deployments": [
            {
                "name": "q",
                "pools": [
                    {
                        "name": "p",
                        "instances": [
                            {
                                "role": "prefill",
                                "count": 2,
                                "nodes": [["n1"], ["n2"]],
                                "gpus": 4,
                                "attentionTp": 1,
                            },
                            {
                                "role": "decode",
                                "count": 1,
                                "nodes": [["n0"]],
                                "gpus": 4,
                                "attentionTp": 1,
                            },
                        ],
                        "kvPath": {"path": "RDMA ib0"},
                    }
                ],
            }
        ],
    }
    instances = planned_instances(doc, "q")
    plans = []
    for inst in instances:
        plans.append(plan_on(sub_fleet(f, inst.nodes)))
    launch = deployment_launch("q", instances, plans, QWEN)
    (config,) = launch.files.values()
    host, port, servers = extract_disagg_cfg(**yaml.safe_load(dump_document(config, "yaml")))
    assert (host, port) == ("0.0.0.0", 8000)
    assert [(s.type, s.hostname, s.port) for s in servers] == [
        ("ctx", "n1", TRTLLM_SERVER_PORT),
        ("ctx", "n2", TRTLLM_SERVER_PORT),
        ("gen", "n0", TRTLLM_SERVER_PORT),
    ]
    assert all(s.other_args == {"backend": "pytorch"} for s in servers)
    for il in launch.instances:  # each server listens where the YAML says
        ns = serve_parser().parse_args(list(il.recipe.nodes[0].argv[1:]))
        assert ns.port == TRTLLM_SERVER_PORT and ns.host == "0.0.0.0"


def test_the_transcription_refuses_what_trtllm_refuses() -> None:
    with pytest.raises(ValueError, match="should be equal to the number of instances"):
        extract_disagg_cfg(context_servers={"num_instances": 2, "urls": ["a:1"]})
    with pytest.raises(ValueError, match="Duplicated ctx server config"):
        extract_disagg_cfg(context_servers={"num_instances": 2, "urls": ["a:1", "a:1"]})
    good = trtllm_disagg_config(["a:8000"], ["b:8000"])
    extract_disagg_cfg(**good)
