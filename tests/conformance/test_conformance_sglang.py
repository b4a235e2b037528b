"""SGLang 0.5.23's own code loads mixfleet's exports and makes the replica choice mixfleet models.

Against the real ``python/sglang/srt/eplb/expert_location.py`` and
``expert_location_dispatch.py`` of the pinned wheel (imported on the CPU, stand-ins listed in
``engine_source.py``):

(a) every ``--init-expert-location`` export loads with
    ``ExpertLocationMetadata.init_by_mapping(model_config, **data, moe_ep_rank=r)`` for every
    rank, with the physical width, slots per rank and replicas the plan says; Mixtral gets no
    metadata, and its first MoE forward then fails as measured;
(b) :func:`policies.estimate.replica_choice.sglang_static_map` equals, for every rank, SGLang's own
    ``logical_to_rank_dispatch_physical_map`` (``--moe-a2a-backend deepep``,
    ``--ep-dispatch-algorithm static``) on random maps, and SGLang without an all-to-all
    backend splits an expert's tokens evenly over its replicas, as the ``even`` rule says.
"""

from __future__ import annotations
import __future__

import ast
import enum
import math
import random
from collections import Counter
from typing import Any

import pytest
from conformance import engine_source as es
from conformance.configs import DEEPSEEK, QWEN3
from conformance.plans import H100, eplb_plan, fleet_of

es.require("sglang")

from policies.estimate.engines import EngineSpec, resolve_runtime  # noqa: E402
from policies.estimate.execution import SGLANG_PLACEMENT_FAMILIES  # noqa: E402
from policies.estimate.replica_choice import replicas_of, served_shares, sglang_static_map  # noqa: E402
from policies.exports.engine import export_plan  # noqa: E402
from policies.model.architecture import ModelSpec, from_hf_config, preset  # noqa: E402
from policies.plan import Plan  # noqa: E402

pytestmark = pytest.mark.conformance

SG = es.sglang()
EL = SG.expert_location


def plan_for(
    model: ModelSpec,
    *,
    nodes: int,
    per_node: int,
    redundant: int,
    seed: int,
    gpu: str = H100,
) -> Plan:
    fleet = fleet_of(
        f"h100x{nodes * per_node}", [(f"h100-{i}", gpu, per_node) for i in range(nodes)]
    )
    return eplb_plan(
        model, fleet, engine="sglang", zipf=f"synthetic:zipf:1.3:seed={seed}", redundant=redundant
    )


def metadata(doc: dict[str, Any], model: ModelSpec, rank: int) -> Any:
    config = es.sglang_model_config(model.family, model.num_layers, model.num_experts)
    return EL.ExpertLocationMetadata.init_by_mapping(config, **doc, moe_ep_rank=rank)


# --------------------------------------------------------------------- (a) loading


@pytest.mark.parametrize(
    ("config", "nodes", "per_node", "redundant"),
    [(DEEPSEEK, 2, 2, 4), (DEEPSEEK, 2, 4, 8), (QWEN3, 2, 2, 8), (QWEN3, 1, 4, 0)],
)
def test_every_rank_loads_the_export(
    config: dict[str, Any], nodes: int, per_node: int, redundant: int
) -> None:
    model = from_hf_config(config, "mini")
    plan = plan_for(model, nodes=nodes, per_node=per_node, redundant=redundant, seed=3)
    doc = export_plan(plan, "sglang", model)
    ep = nodes * per_node
    rows = doc["physical_to_logical_map"]
    expected = sglang_static_map(rows, model.num_experts, ep, per_node)
    with es.sglang_runtime(SG, ep_size=ep, nnodes=nodes, num_redundant=redundant):
        for rank in range(ep):
            md = metadata(doc, model, rank)
            assert md is not None
            assert md.num_layers == model.num_layers
            assert md.num_physical_experts == model.num_experts + redundant
            assert md.num_local_physical_experts == plan.slots_per_gpu
            assert md.physical_to_logical_map.tolist() == rows
            assert md.logical_to_rank_dispatch_physical_map.tolist() == expected[rank]
            for layer, row in enumerate(rows):  # every candidate holds its expert
                for e in range(model.num_experts):
                    assert all(row[p] == e for p in md.logical_to_all_physical(layer, e))
    # Without an all-to-all backend no rank collapses: each expert keeps all its replicas.
    with es.sglang_runtime(
        SG,
        ep_size=ep,
        nnodes=nodes,
        num_redundant=redundant,
        a2a_backend="none",
        dispatch="dynamic",
    ):
        md = metadata(doc, model, 0)
        for layer, row in enumerate(rows):
            for e, cands in enumerate(replicas_of(row, model.num_experts)):
                assert md.logical_to_all_physical(layer, e) == cands


def test_the_deepseek_v3_preset_export_loads_on_every_rank() -> None:
    """Full size: 61 decoder layers (3 dense), 256 experts + 32 redundant on 2 x 4 H200s."""
    model = preset("deepseek-v3")
    plan = plan_for(model, nodes=2, per_node=4, redundant=32, seed=11, gpu="H200-SXM-141GB")
    doc = export_plan(plan, "sglang", model)
    rows = doc["physical_to_logical_map"]
    assert len(rows) == 61 and len(rows[0]) == 288
    expected = sglang_static_map(rows, 256, 8, 4)
    with es.sglang_runtime(SG, ep_size=8, nnodes=2, num_redundant=32):
        for rank in range(8):
            md = metadata(doc, model, rank)
            assert md.num_local_physical_experts == 36
            assert md.logical_to_rank_dispatch_physical_map.tolist() == expected[rank]


def test_families_with_expert_location_support_are_the_ones_mixfleet_exports() -> None:
    """SGLANG_PLACEMENT_FAMILIES is exactly the mixfleet families whose SGLang model class
    (resolved through the models' EntryClass) has get_model_config_for_expert_location."""
    supported = {
        family
        for family, arch in es.SGLANG_ARCHS.items()
        if es.find_method(SG.models_dir, arch, "get_model_config_for_expert_location")
    }
    assert supported == set(SGLANG_PLACEMENT_FAMILIES) & set(es.SGLANG_ARCHS)
    assert "mixtral" not in supported


def test_mixtral_gets_no_metadata_and_its_first_moe_forward_fails() -> None:
    mixtral = es.sglang_model_config("mixtral", 2, 8)
    rows = [[*range(8), 0, 1, 2, 3]] * 2
    with es.sglang_runtime(SG, ep_size=4, nnodes=1, num_redundant=4):
        md = EL.ExpertLocationMetadata.init_by_mapping(
            mixtral, physical_to_logical_map=rows, moe_ep_rank=0
        )
        assert md is None
        EL.set_global_expert_location_metadata(md)
        with pytest.raises(AssertionError, match="Expert dispatch requires placement metadata"):
            SG.dispatch.ExpertLocationDispatchInfo.init_new(layer_id=0)


def test_an_extra_key_is_a_type_error() -> None:
    """Why the engine file carries nothing but the map: the manifest goes beside it."""
    model = from_hf_config(QWEN3, "mini")
    rows = [list(range(32))] * 4
    with es.sglang_runtime(SG, ep_size=4, nnodes=1, num_redundant=0), pytest.raises(TypeError):
        metadata({"physical_to_logical_map": rows, "world_size": 4}, model, 0)


def test_elastic_stand_in_matches_the_real_function() -> None:
    """The real elastic_expanded_world_enabled returns False while no elastic-EP state manager
    exists (ElasticEPStateManager._instance is None until elastic EP is initialised)."""
    path = SG.models_dir.parent / "elastic_ep" / "elastic_ep.py"
    fn = es.function_source(path, "elastic_expanded_world_enabled")
    body = [s for s in fn.body if not isinstance(s, ast.Expr)]  # skip the docstring
    assert ast.unparse(body[0]) == "inst = ElasticEPStateManager.instance()"
    assert ast.unparse(body[1]) == "if inst is None:\n    return False"
    text = path.read_text(encoding="utf-8")
    assert "    _instance: Optional[ElasticEPState] = None\n" in text
    assert "    def instance(cls) -> ElasticEPState:\n        return cls._instance\n" in text


# -------------------------------------------------------------- (b) replica choice


def random_rows(
    rng: random.Random, *, layers: int, dense: int, experts: int, ep: int, slots: int
) -> list[list[int]]:
    """A whole ``--init-expert-location`` map: ``dense`` trivial rows first, then MoE rows
    whose experts have 1..4 replicas, shuffled, grouped (an expert's replicas side by side:
    on one GPU or node) or grouped and rotated."""
    physical = ep * slots
    rows = [[p % experts for p in range(physical)] for _ in range(dense)]
    for _ in range(layers - dense):
        counts = [1] * experts
        for _ in range(physical - experts):
            counts[rng.choice([e for e in range(experts) if counts[e] < 4])] += 1
        order = list(range(experts))
        rng.shuffle(order)
        row = [e for e in order for _ in range(counts[e])]
        style = rng.choice(["shuffled", "grouped", "rotated"])
        if style == "shuffled":
            rng.shuffle(row)
        elif style == "rotated":
            k = rng.randrange(physical)
            row = row[k:] + row[:k]
        rows.append(row)
    return rows


CASES = [(ep, nnodes) for ep in (2, 4, 8) for nnodes in (1, 2, 4) if ep % nnodes == 0]


@pytest.mark.parametrize("seed", range(40))
def test_static_map_equals_sglangs_own_on_random_maps(seed: int) -> None:
    rng = random.Random(seed)
    ep, nnodes = CASES[seed % len(CASES)]
    slots = rng.choice([2, 3, 4, 6])
    physical = ep * slots
    experts = rng.randint(math.ceil(physical / 4), physical)
    layers, dense = rng.randint(2, 5), rng.randint(0, 1)
    rows = random_rows(rng, layers=layers, dense=dense, experts=experts, ep=ep, slots=slots)
    ours = sglang_static_map(rows, experts, ep, ep // nnodes)
    config = es.sglang_model_config("deepseek_v3", layers, experts)
    with es.sglang_runtime(SG, ep_size=ep, nnodes=nnodes, num_redundant=physical - experts):
        for rank in range(ep):
            md = EL.ExpertLocationMetadata.init_by_mapping(
                config, physical_to_logical_map=rows, moe_ep_rank=rank
            )
            assert md.logical_to_rank_dispatch_physical_map.tolist() == ours[rank], (
                f"rank {rank} of ep {ep} over {nnodes} nodes"
            )


def test_without_a2a_backend_tokens_split_evenly_over_replicas() -> None:
    """``--moe-a2a-backend none``: SGLang resolves dispatch to ``dynamic`` and picks the
    replica by token row (``_topk_ids_logical_to_physical_dynamic``, rank-invariant); mixfleet
    models it as ``even``. 840 tokens: a multiple of every replica count 1..8."""
    import torch

    rng = random.Random(7)
    rows = random_rows(rng, layers=3, dense=1, experts=12, ep=4, slots=6)
    config = es.sglang_model_config("qwen3_moe", 3, 12)
    runtime = resolve_runtime(EngineSpec("sglang"), ["ampere"] * 4, ["n0"] * 4)
    assert runtime.a2a_backend == "none" and runtime.dispatch == "even"
    shares = served_shares(runtime, rows, 12, [0.25] * 4)
    with es.sglang_runtime(
        SG, ep_size=4, nnodes=1, num_redundant=12, a2a_backend="none", dispatch="dynamic"
    ):
        md = EL.ExpertLocationMetadata.init_by_mapping(
            config, physical_to_logical_map=rows, moe_ep_rank=None
        )
        EL.set_global_expert_location_metadata(md)
        for layer, row in enumerate(rows):
            info = SG.dispatch.ExpertLocationDispatchInfo.init_new(layer_id=layer)
            assert info.rank_invariant
            for e in range(12):
                topk = torch.full((840, 1), e, dtype=torch.int64)
                picked = SG.dispatch.topk_ids_logical_to_physical(topk, info).flatten().tolist()
                counts = Counter(picked)
                for p, c in counts.items():
                    assert row[p] == e
                    assert c / 840 == pytest.approx(shares[layer][p])
                assert len(counts) == row.count(e)


def test_deepep_runs_its_normal_kernels_in_prefill_and_low_latency_in_decode() -> None:
    """SGLang's ``--deepep-mode`` defaults to ``auto``, which resolves to the normal
    (forwarding) kernels for a batch that extends and to the low-latency kernels otherwise:
    the exchange mixfleet prices for each phase (:meth:`Runtime.exchange_in`)."""
    args = es.sglang_args()
    assert args.parser.parse_args(["--model-path", "m"]).deepep_mode == "auto"
    mode = _deepep_mode()
    auto = mode(args.parser.parse_args(["--model-path", "m"]).deepep_mode)
    runtime = resolve_runtime(EngineSpec(name="sglang"), ["hopper"] * 16, ["a"] * 8 + ["b"] * 8)
    assert runtime.a2a_backend == "deepep"
    for decode in (False, True):
        kernels = auto.resolve(is_extend_in_batch=not decode)
        expected = "alltoall" if kernels.is_low_latency() else "forwarded"
        assert kernels.is_normal() != kernels.is_low_latency()
        assert runtime.exchange_in(decode) == expected, (decode, kernels)


def _deepep_mode() -> Any:
    """SGLang's ``DeepEPMode`` enum, compiled from its source alone (its module imports
    torch and the CUDA layers)."""
    path = es.source_dir("sglang") / "sglang" / "srt" / "layers" / "moe" / "utils.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepEPMode"]
    module = ast.Module(body=[cls], type_ignores=[])
    namespace: dict[str, Any] = {"Enum": enum.Enum, "__name__": "sglang_deepep_mode"}
    flags = __future__.annotations.compiler_flag  # as its module compiles it
    exec(compile(module, str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return namespace["DeepEPMode"]
