"""vLLM 0.33.0's own EPLB code takes mixfleet's vLLM export, and its replica choice is even.

Against the real ``vllm/distributed/eplb/eplb_state.py``, ``vllm/config/parallel.py`` and
``vllm/model_executor/layers/fused_moe/router/base_router.py`` of the pinned wheel:

(a) ``EplbState.add_model`` builds the live state a server starts with (its default layout,
    ``logical_to_physical_map`` 1024 wide) and ``EplbState.update_mapping`` installs the
    export's ``physical_to_logical_map``: the live maps then hold exactly the plan's replicas
    and the export's ``logical_replica_count``. The model and parallel configuration are
    stand-ins carrying the fields ``add_model`` reads; the weight transport
    (``get_eplb_group``, ``create_eplb_communicator``) is replaced for the test, as the mapping
    code only stores it. ``--eplb-config`` with mixfleet's ``step_interval`` is accepted by the
    real ``EPLBConfig`` and puts vLLM's first rebalance 2**60 steps away (750 by default).
(b) The replica choice: the statements of vLLM's own routing kernel
    (``_eplb_map_and_record_i32_kernel``: ``(token_idx * 2654435769 & 0xFFFFFFFF) %
    replica_count``) are compiled from its source and run on CPU tensors (the kernel itself is
    triton and CUDA-only); every replica gets 1/c of its expert's tokens, as mixfleet's
    ``even`` rule says.
"""

from __future__ import annotations

import ast
import json
import types
from typing import Any

import pytest
from conformance import engine_source as es
from conformance.configs import MIXTRAL, QWEN3
from conformance.plans import H100, eplb_plan, fleet_of

es.require("vllm")

import torch  # noqa: E402

from policies.estimate.engines import EngineSpec, resolve_runtime  # noqa: E402
from policies.estimate.replica_choice import served_shares  # noqa: E402
from policies.exports.engine import (  # noqa: E402
    VLLM_EPLB_FAMILIES,
    VLLM_LIVE_MAP_WIDTH,
    VLLM_NO_REBALANCE_STEP_INTERVAL,
    export_plan,
)
from policies.launch import launch_recipe  # noqa: E402
from policies.model.architecture import ModelSpec, from_hf_config  # noqa: E402
from policies.plan import Plan  # noqa: E402

pytestmark = pytest.mark.conformance

VL = es.vllm()


def plan_for(model: ModelSpec, *, gpus: int, redundant: int, seed: int) -> Plan:
    nodes = [
        (name, gpu, gpus // 2) for name, gpu in (("a100-0", "A100-SXM4-80GB"), ("h100-0", H100))
    ]
    fleet = fleet_of("mixed", nodes, nvlink_gbytes_per_s=600)
    return eplb_plan(
        model, fleet, engine="vllm", zipf=f"synthetic:zipf:1.4:seed={seed}", redundant=redundant
    )


class _Model:
    """The ``MixtureOfExperts`` attributes ``EplbState.add_model`` reads."""

    def __init__(self, experts: int, redundant: int, moe_layers: int, ep: int) -> None:
        self.num_routed_experts = self.num_logical_experts = experts
        self.num_redundant_experts = redundant
        self.num_physical_experts = experts + redundant
        self.num_local_physical_experts = (experts + redundant) // ep
        self.num_moe_layers = moe_layers
        self.num_expert_groups = 1
        self.moe_layers: list[Any] = []
        self.expert_weights = [[torch.zeros(self.num_local_physical_experts, 4)]] * moe_layers
        self.installed: tuple[Any, ...] = ()

    def set_eplb_state(self, *tensors: Any) -> None:
        self.installed = tensors


class _ModelConfig:
    model = "mini"

    def compute_hash(self) -> str:
        return "mini"


def live_state(monkeypatch: pytest.MonkeyPatch, model: _Model, eplb_config: Any) -> tuple[Any, Any]:
    """vLLM's EplbState after ``add_model``, as a server has it before the first step."""
    es_mod = VL.eplb_state
    monkeypatch.setattr(es_mod, "get_eplb_group", lambda: object())
    monkeypatch.setattr(es_mod, "create_eplb_communicator", lambda **_: object())
    parallel = types.SimpleNamespace(
        eplb_config=eplb_config, enable_elastic_ep=False, num_ubatches=0
    )
    state = es_mod.EplbState(parallel, torch.device("cpu"))
    state.add_model(model, _ModelConfig())
    return state, state.model_states["mini"]


def eplb_config(redundant: int, step_interval: int | None = None) -> Any:
    fields: dict[str, Any] = {"num_redundant_experts": redundant, "communicator": "torch_gloo"}
    if step_interval is not None:
        fields["step_interval"] = step_interval
    return VL.parallel_config.EPLBConfig(**fields)


# --------------------------------------------------------------------- (a) loading


@pytest.mark.parametrize(("config", "gpus", "redundant"), [(QWEN3, 4, 8), (MIXTRAL, 4, 4)])
def test_update_mapping_installs_the_export(
    monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], gpus: int, redundant: int
) -> None:
    model = from_hf_config(config, "mini")
    plan = plan_for(model, gpus=gpus, redundant=redundant, seed=5)
    doc = export_plan(plan, "vllm", model)
    fake = _Model(model.num_experts, redundant, model.num_moe_layers, gpus)
    conf = eplb_config(redundant, VLLM_NO_REBALANCE_STEP_INTERVAL)
    state, ms = live_state(monkeypatch, fake, conf)
    initial = VL.eplb_state.EplbState.build_initial_global_physical_to_logical_map(
        model.num_experts, redundant
    )
    assert ms.physical_to_logical_map.tolist() == [initial] * model.num_moe_layers
    assert ms.logical_to_physical_map.shape[-1] == VLLM_LIVE_MAP_WIDTH

    new = torch.tensor(doc["physical_to_logical_map"])
    state.update_mapping(_ModelConfig(), new)
    assert ms.physical_to_logical_map.tolist() == doc["physical_to_logical_map"]
    assert ms.logical_replica_count.tolist() == doc["logical_replica_count"]
    live = ms.logical_to_physical_map.tolist()
    assert len(live[0][0]) == VLLM_LIVE_MAP_WIDTH
    for li, row in enumerate(doc["physical_to_logical_map"]):
        for e in range(model.num_experts):
            slots = [p for p in live[li][e] if p >= 0]
            assert slots == [p for p, x in enumerate(row) if x == e]
            assert live[li][e][len(slots) :] == [-1] * (VLLM_LIVE_MAP_WIDTH - len(slots))
    # the same maps vLLM's own derivation gives
    log2phy, counts = VL.eplb_state.compute_logical_maps(new, model.num_experts)
    assert counts.tolist() == doc["logical_replica_count"]
    assert log2phy.shape[-1] == max(max(c) for c in doc["logical_replica_count"])


def test_a_recipe_without_redundant_slots_creates_the_state_it_installs_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R = 0 (the automatic choice on several fleets). vLLM's model runner creates its
    ``EplbState`` only under ``parallel_config.enable_eplb`` (``GPUModelRunner.load_model``),
    and a placement is installed through that state: the recipe passes ``--enable-eplb`` (a
    flag of vLLM's own argument definitions) with an ``--eplb-config`` the real
    ``EPLBConfig`` accepts, and the state built from it installs the plan's export."""
    fn = es.function_source(VL.root / "v1/worker/gpu_model_runner.py", "load_model")
    guarded, made = 0, 0
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "EplbState":
            made += 1
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and "enable_eplb" in ast.unparse(node.test):
            guarded += sum(
                1
                for n in ast.walk(node)
                if isinstance(n, ast.Call) and ast.unparse(n.func) == "EplbState"
            )
    assert made >= 1 and guarded == made  # no EplbState without enable_eplb
    args = (VL.root / "engine/arg_utils.py").read_text(encoding="utf-8")
    assert '"--enable-eplb"' in args and "eplb_config" in args

    model = from_hf_config(MIXTRAL, "mini")
    plan = plan_for(model, gpus=4, redundant=0, seed=5)
    assert plan.num_redundant == 0
    default = VL.eplb_state.EplbState.build_initial_global_physical_to_logical_map(
        model.num_experts, 0
    )
    doc = export_plan(plan, "vllm", model)
    assert any(row != default for row in doc["physical_to_logical_map"])  # not vLLM's own
    argv = launch_recipe(plan, model).nodes[0].argv
    assert "--enable-eplb" in argv and "--enable-expert-parallel" in argv
    fields = json.loads(argv[argv.index("--eplb-config") + 1])
    conf = VL.parallel_config.EPLBConfig(**fields, communicator="torch_gloo")
    assert conf.num_redundant_experts == 0

    fake = _Model(model.num_experts, 0, model.num_moe_layers, 4)
    state, ms = live_state(monkeypatch, fake, conf)
    state.update_mapping(_ModelConfig(), torch.tensor(doc["physical_to_logical_map"]))
    assert ms.physical_to_logical_map.tolist() == doc["physical_to_logical_map"]
    assert ms.logical_replica_count.tolist() == doc["logical_replica_count"]


def test_mixfleets_step_interval_keeps_vllms_rebalancing_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Model(8, 4, 2, 4)
    state, _ = live_state(monkeypatch, fake, eplb_config(4))
    # default EPLBConfig: the counter starts at 3/4 of 3000, so vLLM rebalances after 750 steps
    assert state.expert_rearrangement_step_interval - state.expert_rearrangement_step == 750
    state, _ = live_state(monkeypatch, fake, eplb_config(4, VLLM_NO_REBALANCE_STEP_INTERVAL))
    left = state.expert_rearrangement_step_interval - state.expert_rearrangement_step
    assert left == 2**60


def test_weight_rearrangement_takes_the_exports_shape() -> None:
    """rearrange_expert_weights_inplace(old, new, ...) wants two [L_moe][P] index maps: the
    live physical_to_logical_map and the export's."""
    fn = es.function_source(
        VL.root / "distributed/eplb/rebalance_execute.py", "rearrange_expert_weights_inplace"
    )
    args = [a.arg for a in fn.args.args]
    assert args[:2] == ["old_global_expert_indices", "new_global_expert_indices"]
    text = ast.unparse(fn)
    assert "new_global_expert_indices.shape == (num_moe_layers, num_physical_experts)" in text


def test_families_with_eplb_are_the_ones_mixfleet_exports() -> None:
    classes = {
        "deepseek_v3": ("deepseek_v2.py", "DeepseekV3ForCausalLM"),
        "deepseek_v2": ("deepseek_v2.py", "DeepseekV2ForCausalLM"),
        "qwen3_moe": ("qwen3_moe.py", "Qwen3MoeForCausalLM"),
        "mixtral": ("mixtral.py", "MixtralForCausalLM"),
        "gpt_oss": ("gpt_oss.py", "GptOssForCausalLM"),
        "qwen2_moe": ("qwen2_moe.py", "Qwen2MoeForCausalLM"),
        "glm4_moe": ("glm4_moe.py", "Glm4MoeForCausalLM"),
        "llama4": ("mllama4.py", "Llama4ForConditionalGeneration"),
        "minimax_m2": ("minimax_m2.py", "MiniMaxM2ForCausalLM"),
    }
    models = VL.root / "model_executor" / "models"

    def is_moe(path: str, cls: str) -> bool:
        tree = ast.parse((models / path).read_text(encoding="utf-8"))
        defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        todo, seen = [cls], set()
        while todo:
            name = todo.pop()
            if name == "MixtureOfExperts":
                return True
            if name in seen or name not in defs:
                continue
            seen.add(name)
            todo += [b.id for b in defs[name].bases if isinstance(b, ast.Name)]
        return False

    assert {f for f, (p, c) in classes.items() if is_moe(p, c)} == set(VLLM_EPLB_FAMILIES)


# -------------------------------------------------------------- (b) replica choice


def _replica_choice() -> Any:
    """vLLM's replica pick, compiled from the statements of its routing kernel."""
    path = VL.root / "model_executor/layers/fused_moe/router/base_router.py"
    kernel = es.function_source(path, "_eplb_map_and_record_i32_kernel")
    wanted = {"KNUTH_MULTIPLIER", "token_idx", "hashed", "replica_idx"}
    body: list[ast.stmt] = []
    names: list[str] = []
    for s in kernel.body:
        target = s.targets[0] if isinstance(s, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in wanted:
            body.append(s)
            names.append(target.id)
    assert names == ["KNUTH_MULTIPLIER", "token_idx", "hashed", "replica_idx"]
    assert ast.unparse(body[0]) == "KNUTH_MULTIPLIER = 2654435769"
    assert ast.unparse(body[2]) == "hashed = token_idx * KNUTH_MULTIPLIER & 4294967295"
    assert ast.unparse(body[3]) == "replica_idx = hashed % replica_count"
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec")

    def pick(offs: Any, num_active_experts: int, replica_count: Any) -> Any:
        scope: dict[str, Any] = {
            "offs": offs,
            "num_active_experts": num_active_experts,
            "replica_count": replica_count,
            "tl": types.SimpleNamespace(int64=torch.int64),
        }
        exec(code, scope)
        return scope["replica_idx"]

    return pick


def test_replica_choice_is_even_as_mixfleet_models_it() -> None:
    pick = _replica_choice()
    model = from_hf_config(QWEN3, "mini")
    plan = plan_for(model, gpus=4, redundant=8, seed=9)
    rows = export_plan(plan, "vllm", model)["physical_to_logical_map"]
    runtime = resolve_runtime(EngineSpec("vllm"), ["hopper"] * 4, ["n0"] * 4)
    assert runtime.dispatch == "even"
    shares = served_shares(runtime, rows, model.num_experts, [0.25] * 4)
    tokens, top_k = 4096, 4
    offs = torch.arange(tokens * top_k, dtype=torch.int64)
    for li, row in enumerate(rows):
        for e in range(model.num_experts):
            slots = [p for p, x in enumerate(row) if x == e]
            count = torch.full((tokens * top_k,), len(slots), dtype=torch.int64)
            idx = pick(offs, top_k, count)[::top_k]  # one of each token's k slots is e
            for r, p in enumerate(slots):
                got = float((idx == r).sum()) / tokens
                assert got == pytest.approx(shares[li][p], abs=2e-3)
