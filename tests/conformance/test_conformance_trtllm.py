"""TensorRT-LLM's MoE load-balancer config checks accept mixfleet's trtllm exports.

TensorRT-LLM's wheel is several GB and its Python imports its CUDA bindings at once, so it
cannot be imported on a CPU machine. This module re-implements only the checks its loader
makes on the file, transcribed from the NVIDIA/TensorRT-LLM source (main, late 2026):

* ``tensorrt_llm/llmapi/llm_args.py`` ``MoeLoadBalancerConfig(StrictBaseModel)`` - pydantic,
  extra fields forbidden; ``num_slots: Optional[int]``, ``initial_global_assignments:
  Optional[Dict[int, List[int]]]``, ``layer_updates_per_iter: int = 0``; ``setup(ep_rank,
  ep_size)`` raises ValueError unless ``num_slots % ep_size == 0``;
  ``get_layer_initial_global_assignments(layer_idx)`` raises ``KeyError: layer_idx N not found
  in initial_global_assignments`` for a missing layer and ValueError for a length other than
  ``num_slots``;
* ``tensorrt_llm/_torch/modules/fused_moe/interface.py`` (the MoE module's load-balancer
  block in ``__init__``): ``len(assignments) == num_slots``, ``num_slots >= num_experts``,
  ``set(assignments) == set(range(num_experts))``, and each rank's
  ``[ep_rank * num_local_slots, (ep_rank + 1) * num_local_slots)`` slice;
* ``tensorrt_llm/_torch/modules/fused_moe/moe_load_balancer.py``
  ``maybe_create_moe_load_balancer``: a balancer only for ``moe_model_arch_list`` and
  ``moe_ep_size > 1``.

Every MoE module asks for its own ``layer_idx``: the decoder's MoE layers and, with
multi-token prediction, the MTP layer at ``num_hidden_layers + k``.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from conformance.configs import DEEPSEEK_MTP, MIXTRAL, QWEN3
from conformance.plans import H100, eplb_plan, fleet_of
from pydantic import BaseModel, ConfigDict, ValidationError

from controlplane.cli.files import dump_document
from policies.exports.engine import TRTLLM_BALANCER_FAMILIES, export_plan
from policies.model.architecture import ModelSpec, from_hf_config, preset
from policies.plan import Plan

pytestmark = pytest.mark.conformance

MOE_MODEL_ARCH_LIST = (
    "DeepseekV3ForCausalLM",
    "MixtralForCausalLM",
    "Llama4ForConditionalGeneration",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""``moe_model_arch_list`` of moe_load_balancer.py."""

FAMILY_ARCH = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


class MoeLoadBalancerConfig(BaseModel):
    """llm_args.py's model: StrictBaseModel is ``extra="forbid"``."""

    model_config = ConfigDict(extra="forbid")

    num_slots: int | None = None
    initial_global_assignments: dict[int, list[int]] | None = None
    layer_updates_per_iter: int = 0

    def setup(self, ep_rank: int, ep_size: int) -> None:
        if self.num_slots is None:
            raise ValueError("`num_slots` cannot be None when calling setup().")
        if self.num_slots % ep_size != 0:
            raise ValueError(
                f"`num_slots` ({self.num_slots}) must be divisible by `ep_size` ({ep_size})."
            )

    def get_layer_initial_global_assignments(self, layer_idx: int) -> list[int] | None:
        if self.initial_global_assignments is None:
            return None
        if layer_idx not in self.initial_global_assignments:
            raise KeyError(f"layer_idx {layer_idx} not found in `initial_global_assignments`.")
        assignments = self.initial_global_assignments[layer_idx]
        if len(assignments) != self.num_slots:
            raise ValueError(
                f"Assignment length ({len(assignments)}) for layer {layer_idx} does not "
                f"match `num_slots` ({self.num_slots})."
            )
        return assignments


def load_on_every_rank(text: str, model: ModelSpec, ep_size: int) -> list[list[int]]:
    """What every rank's MoE modules do with the YAML; returns each rank's local experts of
    the first MoE layer."""
    assert FAMILY_ARCH[model.family] in MOE_MODEL_ARCH_LIST and ep_size > 1
    config = MoeLoadBalancerConfig(**yaml.safe_load(text))
    layers = [*model.moe_layers, *(model.num_layers + k for k in range(model.mtp_layers))]
    first: list[list[int]] = []
    for rank in range(ep_size):
        config.setup(ep_rank=rank, ep_size=ep_size)
        assert config.num_slots is not None
        local = config.num_slots // ep_size
        for layer_idx in layers:
            assignments = config.get_layer_initial_global_assignments(layer_idx)
            assert isinstance(assignments, list)
            assert len(assignments) == config.num_slots
            assert config.num_slots >= model.num_experts
            assert set(assignments) == set(range(model.num_experts))
            mine = assignments[rank * local : (rank + 1) * local]
            assert len(mine) == local
            if layer_idx == layers[0]:
                first.append(mine)
    return first


def plan_for(model: ModelSpec, *, gpus: int, redundant: int, gpu: str = H100) -> Plan:
    fleet = fleet_of("trt", [(f"n{i}", gpu, gpus // 2) for i in range(2)])
    return eplb_plan(
        model, fleet, engine="trtllm", zipf="synthetic:zipf:1.2:seed=4", redundant=redundant
    )


@pytest.mark.parametrize(
    ("config", "gpus", "redundant"),
    [(DEEPSEEK_MTP, 4, 4), (DEEPSEEK_MTP, 8, 8), (QWEN3, 4, 8), (MIXTRAL, 4, 0)],
)
def test_every_rank_loads_the_export(config: dict[str, Any], gpus: int, redundant: int) -> None:
    model = from_hf_config(config, "mini")
    plan = plan_for(model, gpus=gpus, redundant=redundant)
    text = dump_document(export_plan(plan, "trtllm", model), "yaml")
    slots = plan.slots_per_gpu
    assert slots is not None
    first = load_on_every_rank(text, model, gpus)
    assert first == [[s.expert for s in g.experts[0]] for g in plan.gpus]


def test_the_deepseek_v3_preset_with_its_mtp_layer_loads() -> None:
    model = preset("deepseek-v3")
    plan = plan_for(model, gpus=8, redundant=32, gpu="H200-SXM-141GB")
    text = dump_document(export_plan(plan, "trtllm", model), "yaml")
    load_on_every_rank(text, model, 8)
    assert 61 in yaml.safe_load(text)["initial_global_assignments"]


def test_an_export_without_the_mtp_layer_fails_as_measured() -> None:
    """Without the model the export cannot know the MTP layer: TensorRT-LLM's MTP MoE module
    then raises the KeyError seen on a real DeepSeek-V3 launch."""
    model = from_hf_config(DEEPSEEK_MTP, "mini")
    plan = plan_for(model, gpus=4, redundant=4)
    text = dump_document(export_plan(plan, "trtllm"), "yaml")
    with pytest.raises(KeyError, match="layer_idx 5 not found"):
        load_on_every_rank(text, model, 4)


def test_the_config_forbids_extra_fields_and_unequal_slots() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MoeLoadBalancerConfig(num_slots=8, initial_global_assignments={}, ep_size=4)  # type: ignore[call-arg]
    config = MoeLoadBalancerConfig(num_slots=10, initial_global_assignments={0: list(range(10))})
    with pytest.raises(ValueError, match="must be divisible by `ep_size` \\(4\\)"):
        config.setup(ep_rank=0, ep_size=4)


def test_families_with_a_balancer_are_the_ones_mixfleet_exports() -> None:
    with_balancer = {f for f, arch in FAMILY_ARCH.items() if arch in MOE_MODEL_ARCH_LIST}
    assert with_balancer == set(TRTLLM_BALANCER_FAMILIES)
