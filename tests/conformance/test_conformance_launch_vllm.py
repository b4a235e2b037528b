"""vLLM 0.33.0's own argument parser reads mixfleet's launch recipes as planned.

Every node's ``vllm serve`` command of an aggregated, prefill and decode recipe is parsed by
the pinned wheel's ``make_arg_parser`` (``vllm/entrypoints/common/cli_args.py``) and turned
into ``EngineArgs`` (``EngineArgs.from_cli_args``); the PARSED values are checked against the
plan: TP and DP sizes, expert parallelism, all-to-all backend, the DP rendezvous per node,
EPLB, and for prefill/decode servers the ``KVTransferConfig`` vLLM builds from
``--kv-transfer-config`` (connector, ``kv_role``, producer/consumer). The connectors mixfleet
names are registered in vLLM's ``KVConnectorFactory``; ``NixlConnector`` deprecates
``kv_both`` and its side channel defaults to ``localhost`` (why the recipe sets
``VLLM_NIXL_SIDE_CHANNEL_HOST`` per node), read from vLLM's source.
"""

from __future__ import annotations

import ast
from typing import Any

import pytest
from conformance import engine_source as es
from conformance.configs import QWEN3
from conformance.plans import H100, eplb_plan, fleet_of

es.require("vllm")

from policies.exports.engine import vllm_needs_eplb  # noqa: E402
from policies.launch import (  # noqa: E402
    NODE_ADDR_REF,
    TRANSFER_BACKENDS,
    KvTransfer,
    launch_recipe,
)
from policies.model.architecture import ModelSpec, from_hf_config  # noqa: E402
from policies.plan import Plan  # noqa: E402

pytestmark = pytest.mark.conformance

ARGS = es.vllm_args()
ROOT = es.source_dir("vllm") / "vllm"


def plan_for(model: ModelSpec, *, nodes: int, per_node: int, redundant: int) -> Plan:
    fleet = fleet_of("pd", [(f"h100-{i}", H100, per_node) for i in range(nodes)])
    return eplb_plan(
        model, fleet, engine="vllm", zipf="synthetic:zipf:1.3:seed=6", redundant=redundant
    )


def parsed(argv: tuple[str, ...]) -> tuple[Any, Any]:
    """vLLM's parsed namespace and EngineArgs of a recipe's ``vllm serve MODEL ...``."""
    assert argv[:2] == ("vllm", "serve")
    ns = ARGS.parser.parse_args(list(argv[2:]))
    ns.model = ns.model_tag  # what `vllm serve` does with its positional model
    return ns, ARGS.engine_args.from_cli_args(ns)


@pytest.mark.parametrize(
    ("role", "connector", "nodes"),
    [
        ("aggregated", "", 2),
        ("prefill", "NixlConnector", 2),
        ("decode", "NixlConnector", 2),
        ("prefill", "MooncakeConnector", 1),
        ("decode", "MooncakeConnector", 1),
    ],
)
def test_every_role_parses_to_the_plans_shape_and_kv_transfer(
    role: str, connector: str, nodes: int
) -> None:
    model = from_hf_config(QWEN3, "mini")
    plan = plan_for(model, nodes=nodes, per_node=2, redundant=8)
    kv = None if role == "aggregated" else KvTransfer("RDMA ib0", connector)
    r = launch_recipe(
        plan, model, model_path="/m/q", dist_init_addr="10.0.0.1:13345", role=role, kv=kv
    )
    n, tp = len(plan.gpus), plan.gpus[0].attention_tp
    for i, node in enumerate(r.nodes):
        ns, ea = parsed(node.argv)
        assert ea.model == "/m/q"
        assert (ea.tensor_parallel_size, ea.data_parallel_size) == (tp, n // tp)
        assert ea.enable_expert_parallel is True
        assert ea.all2all_backend == plan.engine.a2a_backend
        assert ea.enable_eplb is vllm_needs_eplb(plan)
        if ea.enable_eplb:
            assert ea.eplb_config.num_redundant_experts == plan.num_redundant
        if nodes > 1:
            first, end = node.rank_range
            assert ea.data_parallel_size_local == (end - first) // tp
            assert ea.data_parallel_start_rank == first // tp
            assert (ea.data_parallel_address, ea.data_parallel_rpc_port) == ("10.0.0.1", 13345)
            assert bool(ns.headless) is (i > 0)
        kvt = ea.kv_transfer_config
        if role == "aggregated":
            assert kvt is None
            continue
        assert isinstance(kvt, ARGS.kv_transfer.KVTransferConfig)
        assert kvt.kv_connector == connector
        assert kvt.kv_role == ("kv_producer" if role == "prefill" else "kv_consumer")
        assert kvt.is_kv_producer is (role == "prefill")
        assert kvt.is_kv_consumer is (role == "decode")
        assert (node.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == NODE_ADDR_REF) is (
            connector == "NixlConnector"
        )


def test_the_connectors_mixfleet_names_are_registered() -> None:
    path = ROOT / "distributed/kv_transfer/kv_connector/factory.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "KVConnectorFactory.register_connector"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    assert set(TRANSFER_BACKENDS["vllm"]) <= names


def test_nixl_wants_a_producer_and_a_consumer_and_a_reachable_side_channel() -> None:
    connector = (ROOT / "distributed/kv_transfer/kv_connector/v1/nixl/connector.py").read_text(
        encoding="utf-8"
    )
    assert "Using kv_role='kv_both' with NixlConnector is deprecated" in connector
    assert "kv_role='kv_producer' for prefill instances" in connector
    assert ARGS.envs.environment_variables["VLLM_NIXL_SIDE_CHANNEL_HOST"]() in (
        "localhost",
        NODE_ADDR_REF,  # set by a caller's environment
    )
    with pytest.raises(ValueError, match="Please specify kv_role"):
        ARGS.kv_transfer.KVTransferConfig(kv_connector="NixlConnector")
