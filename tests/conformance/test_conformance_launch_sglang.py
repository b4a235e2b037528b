"""SGLang 0.5.23's own argument parser reads mixfleet's launch recipes as planned.

Every node's command of an aggregated, prefill and decode recipe is parsed by the pinned
wheel's ``ServerArgs.add_cli_args`` parser and ``ServerArgs.from_cli_args`` (stand-ins listed
in ``engine_source.py``), and the PARSED values are checked against the plan: tensor, expert
and attention-DP widths through SGLang's own derivations (``runtime_context.parallel_widths_of``,
``attn_dp_enabled_of``, ``num_dp_ranks_of``), the all-to-all backend, redundant slots,
placement file, dispatch rule, rendezvous, and for prefill/decode servers the
disaggregation mode, transfer backend and bootstrap port. The transfer backends mixfleet
names are among SGLang's choices, and the prefill default that makes a router send
``disagg_prefill_dp_rank`` with a routed rank is read from SGLang's source.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import pytest
from conformance import engine_source as es
from conformance.configs import DEEPSEEK, QWEN3
from conformance.plans import H100, eplb_plan, fleet_of

es.require("sglang")

from policies.launch import (  # noqa: E402
    SGLANG_BOOTSTRAP_PORT,
    TRANSFER_BACKENDS,
    KvTransfer,
    LaunchRecipe,
    launch_recipe,
)
from policies.model.architecture import ModelSpec, from_hf_config  # noqa: E402
from policies.plan import Plan  # noqa: E402

pytestmark = pytest.mark.conformance

ARGS = es.sglang_args()
RC = ARGS.runtime_context


def plan_for(model: ModelSpec, *, nodes: int, per_node: int, redundant: int) -> Plan:
    fleet = fleet_of("pd", [(f"h100-{i}", H100, per_node) for i in range(nodes)])
    return eplb_plan(
        model, fleet, engine="sglang", zipf="synthetic:zipf:1.3:seed=2", redundant=redundant
    )


def parsed(argv: tuple[str, ...]) -> Any:
    """SGLang's ServerArgs from a recipe's command (``python3 -m sglang.launch_server ...``)."""
    assert argv[:3] == ("python3", "-m", "sglang.launch_server")
    return ARGS.server_args.from_cli_args(ARGS.parser.parse_args(list(argv[3:])))


def check_shape(recipe: LaunchRecipe, plan: Plan, path: str) -> None:
    n = len(plan.gpus)
    tp = plan.gpus[0].attention_tp
    k = len(recipe.nodes)
    for i, node in enumerate(recipe.nodes):
        a = parsed(node.argv)
        widths = RC.parallel_widths_of(a)
        assert (a.tp_size, a.ep_size, widths["moe_ep_size"]) == (n, n, n)
        assert (a.attn_dp_size, widths["attn_tp_size"]) == (n // tp, tp)
        # DP attention runs exactly when the plan has DP ranks to route
        assert RC.attn_dp_enabled_of(a) is (n // tp > 1)
        assert RC.num_dp_ranks_of(a) == n // tp
        assert a.moe_a2a_backend == plan.engine.a2a_backend
        assert a.ep_num_redundant_experts == plan.num_redundant
        assert a.init_expert_location == path
        assert a.ep_dispatch_algorithm == plan.engine.dispatch
        assert (a.nnodes, a.node_rank) == (k, i)
        assert a.dist_init_addr == ("10.0.0.1:5000" if k > 1 else None)


@pytest.mark.parametrize(
    ("config", "nodes", "per_node", "redundant"),
    [(QWEN3, 2, 2, 8), (DEEPSEEK, 2, 4, 8), (QWEN3, 1, 4, 0)],
)
def test_aggregated_recipes_parse_to_the_plans_shape(
    config: dict[str, Any], nodes: int, per_node: int, redundant: int
) -> None:
    model = from_hf_config(config, "mini")
    plan = plan_for(model, nodes=nodes, per_node=per_node, redundant=redundant)
    r = launch_recipe(plan, model, placement_path="/p/el.json", dist_init_addr="10.0.0.1:5000")
    check_shape(r, plan, "/p/el.json")
    for node in r.nodes:
        assert parsed(node.argv).disaggregation_mode == "null"


@pytest.mark.parametrize(
    ("role", "path", "backend"),
    [
        ("prefill", "RDMA ib0", "mooncake"),
        ("decode", "RDMA ib0", "mooncake"),
        ("prefill", "NVLink nvl0", "nixl"),
        ("decode", "RDMA ib0", "nixl"),
    ],
)
def test_prefill_and_decode_recipes_parse_to_their_mode_backend_and_bootstrap(
    role: str, path: str, backend: str
) -> None:
    model = from_hf_config(QWEN3, "mini")
    plan = plan_for(model, nodes=2, per_node=2, redundant=8)
    kv = KvTransfer(path, backend if path.startswith("RDMA") else "", bootstrap_port=9100)
    r = launch_recipe(
        plan, model, placement_path="/p/el.json", dist_init_addr="10.0.0.1:5000", role=role, kv=kv
    )
    assert r.transfer_backend == backend
    check_shape(r, plan, "/p/el.json")
    for node in r.nodes:
        a = parsed(node.argv)
        assert a.disaggregation_mode == role
        assert a.disaggregation_transfer_backend == backend
        # the bootstrap server listens on prefill; decode keeps SGLang's default, unused
        assert a.disaggregation_bootstrap_port == (
            9100 if role == "prefill" else SGLANG_BOOTSTRAP_PORT
        )


def test_one_dp_rank_leaves_dp_attention_off() -> None:
    """A plan whose attention is one TP group over all its GPUs has no DP rank to route:
    SGLang's own derivation then runs attention tensor-parallel."""
    model = from_hf_config(QWEN3, "mini")
    plan = plan_for(model, nodes=1, per_node=2, redundant=0)
    share = sum(g.attention_share for g in plan.gpus) / 2
    whole = dataclasses.replace(
        plan,
        gpus=tuple(
            dataclasses.replace(g, attention_tp=2, dp_group=0, attention_share=share)
            for g in plan.gpus
        ),
    )
    r = launch_recipe(whole, model)
    a = parsed(r.nodes[0].argv)
    assert a.attn_dp_size == 1 and RC.parallel_widths_of(a)["attn_tp_size"] == 2
    assert RC.attn_dp_enabled_of(a) is False and RC.num_dp_ranks_of(a) == 1


def test_the_transfer_backends_mixfleet_names_are_sglangs_choices() -> None:
    action = next(
        x for x in ARGS.parser._actions if "--disaggregation-transfer-backend" in x.option_strings
    )
    assert set(TRANSFER_BACKENDS["sglang"]) <= set(action.choices)
    mode = next(x for x in ARGS.parser._actions if "--disaggregation-mode" in x.option_strings)
    assert {"prefill", "decode"} <= set(mode.choices)
    bootstrap = next(
        x for x in ARGS.parser._actions if "--disaggregation-bootstrap-port" in x.option_strings
    )
    assert bootstrap.default == SGLANG_BOOTSTRAP_PORT


def test_a_prefill_server_follows_the_bootstrap_room_unless_told_the_rank() -> None:
    """Why a router that pins DP ranks sends ``disagg_prefill_dp_rank`` (the recipe's note):
    SGLang resolves ``--load-balance-method auto`` to ``follow_bootstrap_room`` on a prefill
    server, and its KV sender fails a transfer whose rank is not ``bootstrap_room mod
    num_dp_ranks`` unless the request carries ``disagg_prefill_dp_rank``."""
    root = es.source_dir("sglang") / "sglang" / "srt"
    hook = es.function_source(root / "arg_groups" / "serving_hook.py", "handle_load_balance_method")
    text = ast.unparse(hook)
    assert (
        "'follow_bootstrap_room' if cfg.disaggregation_mode == 'prefill' else 'round_robin'" in text
    )
    conn = (root / "disaggregation" / "common" / "conn.py").read_text(encoding="utf-8")
    assert "get_parallel().num_dp_ranks > 1 and not req_has_disagg_prefill_dp_rank" in conn
    assert "follow_bootstrap_room conflict" in conn
    prefill = (root / "disaggregation" / "prefill.py").read_text(encoding="utf-8")
    assert "req_has_disagg_prefill_dp_rank=req.disagg_prefill_dp_rank is not None" in prefill
    model = from_hf_config(QWEN3, "mini")
    plan = plan_for(model, nodes=1, per_node=4, redundant=0)
    r = launch_recipe(plan, model, role="prefill", kv=KvTransfer("RDMA ib0"))
    assert plan.engine.dp_balance == "router"
    assert any("disagg_prefill_dp_rank" in n for n in r.notes)
