"""Published Hugging Face ``config.json`` files of the most used open MoE models, read into
:class:`policies.model.architecture.ModelSpec` (tests/fixtures/hf_configs/).

Each fixture holds the fields as published; where a copy dropped fields it says so below.
Sources (the stored copies the fixture files were taken from, unchanged):

* ``AIC``: ai-dynamo/aiconfigurator, aic-core/src/aiconfigurator_core/model_configs/
  ``<org>--<model>_config.json`` at commit 095f58a51c4ca8e61b66ec108d86f223f8d559ce, copies
  of the Hugging Face ``config.json`` of ``<org>/<model>`` (Llama 4: the ``text_config`` and
  top level, ``vision_config`` dropped).
* ``qwen2-57b-a14b``: NVIDIA/TensorRT-LLM tests/unittest/_torch/modeling/
  test_modeling_qwen_moe.py, ``QWEN2_57B_A14B_CONFIG`` (the config.json of
  Qwen/Qwen2-57B-A14B).
* ``qwen1.5-moe-a2.7b-chat``: the fields of Qwen/Qwen1.5-MoE-A2.7B-Chat's config.json as
  two independent public copies give them (a planner test fixture "config.json, fields the
  planner reads", and a model card quoting the config of the -GPTQ-Int4 variant); they
  agree with the defaults of transformers' ``Qwen2MoeConfig``. Fields both lack (dtype,
  token ids) are absent.
* ``glm-4.7``: alibaba/rtp-llm, the GLM-4 MoE model test (``_glm47_config_json``, "the
  fields Glm4Moe._from_config_json reads, with GLM-4.7's real values"); cross-checked
  against AIC ``zai-org--GLM-4.7-FP8_config.json`` (commit 19d098a). GLM-4.7 uses the same
  ``Glm4MoeForCausalLM`` class as GLM-4.5 and GLM-4.6, whose own config.json files were not
  found in the stored public corpora.

Not found publicly in a form that could be copied: GLM-4.5 / 4.6, DeepSeek-V3.1 (only
NVIDIA's NVFP4 re-quantisation), MiniMax-M1 and M2 (M2.5 is used), Hunyuan-A13B (no reader)
and ERNIE 4.5 MoE (read, tested on transformers' documented defaults below). The published totals the parameter counts are checked against are the
models' names and model cards (``235B-A22B`` = 235 B total, 22 B active).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from builders import fleet, workload

from apis.wire.deployment import spec_from_proto, spec_to_proto
from controlplane.cli import main
from policies.errors import InputError
from policies.estimate.costmodel import build_cost_table
from policies.model.architecture import ModelSpec, from_hf_config, preset
from policies.spec.build import DeploymentSpec, resolve_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
REPO = Path(__file__).resolve().parents[2]


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return doc


def spec(name: str) -> ModelSpec:
    return from_hf_config(load(name), name)


@dataclass(frozen=True)
class Expected:
    """What a config must read as. Params in billions: published total, active."""

    family: str
    layers: int
    first_moe: int
    moe_layers: int
    experts: int
    shared: int
    top_k: int
    attention: str
    mtp: int
    total_b: float
    active_b: float


EXPECTED = {
    # DeepSeek-V3 / R1: 671B total, 37B active (model card); MTP layer 61.
    "deepseek-v3": Expected("deepseek_v3", 61, 3, 58, 256, 1, 8, "mla", 1, 671, 37),
    "deepseek-r1": Expected("deepseek_v3", 61, 3, 58, 256, 1, 8, "mla", 1, 671, 37),
    # V3.2 adds the sparse-attention indexer (DeepseekV32ForCausalLM).
    "deepseek-v3.2": Expected("deepseek_v32", 61, 3, 58, 256, 1, 8, "mla", 1, 671, 37),
    # Kimi K2: 1T total, 32B active; model_type kimi_k2, DeepSeek-V3 class.
    "kimi-k2-instruct": Expected("deepseek_v3", 61, 1, 60, 384, 1, 8, "mla", 0, 1000, 32),
    "qwen3-235b-a22b": Expected("qwen3_moe", 94, 0, 94, 128, 0, 8, "gqa", 0, 235, 22),
    "qwen3-30b-a3b": Expected("qwen3_moe", 48, 0, 48, 128, 0, 8, "gqa", 0, 30.5, 3.3),
    "qwen3-coder-480b-a35b-instruct": Expected(
        "qwen3_moe", 62, 0, 62, 160, 0, 8, "gqa", 0, 480, 35
    ),
    # Qwen2-MoE: one shared expert behind a gate. Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B
    # active (model card, embeddings counted in full).
    "qwen2-57b-a14b": Expected("qwen2_moe", 28, 0, 28, 64, 1, 8, "gqa", 0, 57, 14),
    "qwen1.5-moe-a2.7b-chat": Expected("qwen2_moe", 24, 0, 24, 60, 1, 4, "gqa", 0, 14.3, 2.7),
    # Mixtral: 46.7B / 12.9B and 141B / 39B (Mistral's announcements).
    "mixtral-8x7b-v0.1": Expected("mixtral", 32, 0, 32, 8, 0, 2, "gqa", 0, 46.7, 12.9),
    "mixtral-8x22b-v0.1": Expected("mixtral", 56, 0, 56, 8, 0, 2, "gqa", 0, 141, 39),
    # gpt-oss: 21B / 3.6B and 117B / 5.1B (model card).
    "gpt-oss-20b": Expected("gpt_oss", 24, 0, 24, 32, 0, 4, "gqa", 0, 21, 3.6),
    "gpt-oss-120b": Expected("gpt_oss", 36, 0, 36, 128, 0, 4, "gqa", 0, 117, 5.1),
    # GLM-4.7 (GLM-4.5 class): 355B total, 32B active (GLM-4.5 model card).
    "glm-4.7": Expected("glm4_moe", 92, 3, 89, 160, 1, 8, "gqa", 1, 355, 32),
    # Llama 4: 109B / 17B and 400B / 17B including the vision tower (about 1B).
    "llama-4-scout-17b-16e-instruct": Expected("llama4", 48, 0, 48, 16, 1, 1, "gqa", 0, 108, 17),
    "llama-4-maverick-17b-128e-instruct": Expected(
        "llama4", 48, 1, 24, 128, 1, 1, "gqa", 0, 400, 17
    ),
    # MiniMax-M2.5: 230B total, 10B active (model card).
    "minimax-m2.5": Expected("minimax_m2", 62, 0, 62, 256, 0, 8, "gqa", 3, 230, 10),
}


def test_every_fixture_has_an_expectation() -> None:
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_reads_as_the_model(name: str) -> None:
    m, e = spec(name), EXPECTED[name]
    assert m.family == e.family
    assert m.num_layers == e.layers and m.moe_layers[0] == e.first_moe
    assert m.num_moe_layers == e.moe_layers
    assert (m.num_experts, m.num_shared_experts, m.top_k) == (e.experts, e.shared, e.top_k)
    assert m.attention == e.attention and m.mtp_layers == e.mtp


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameter_counts_match_the_published_sizes(name: str) -> None:
    """Total and active parameters within 4% / 12% of the published figures: a wrong
    layer count, expert width or missing shared expert moves them far more."""
    m, e = spec(name), EXPECTED[name]
    assert m.total_params / 1e9 == pytest.approx(e.total_b, rel=0.04)
    # Published active counts differ in whether the unused half of the embeddings counts.
    active = m.active_params + m.embedding_params / 2
    assert min(m.active_params, active) / 1e9 <= e.active_b * 1.12
    assert max(m.active_params, active) / 1e9 >= e.active_b * 0.88


def test_kimi_k2_dispatches_on_architectures() -> None:
    cfg = load("kimi-k2-instruct")
    assert cfg["model_type"] == "kimi_k2"
    renamed = {**cfg, "model_type": "my_k2_finetune"}  # an unknown type, the known class
    assert from_hf_config(renamed, "k2") == from_hf_config(cfg, "k2")
    m = spec("kimi-k2-instruct")
    assert (m.num_q_heads, m.kv_lora_rank, m.q_lora_rank, m.n_group) == (64, 512, 1536, 1)
    assert m.weight_dtype == "fp8" and m.expert_ffn == 2048 and m.dense_ffn == 18432


def test_unknown_keys_of_a_config_json_are_ignored() -> None:
    cfg = {**load("qwen3-30b-a3b"), "some_new_field": {"nested": [1, 2]}, "rope_scaling": None}
    assert from_hf_config(cfg, "q") == from_hf_config(load("qwen3-30b-a3b"), "q")


def test_the_qwen3_preset_is_its_published_config() -> None:
    assert from_hf_config(load("qwen3-235b-a22b"), "qwen3-235b-a22b") == preset("qwen3-235b-a22b")


def test_qwen2_moe_counts_its_shared_expert_and_gate() -> None:
    m = spec("qwen2-57b-a14b")
    h = 3584
    assert (m.shared_expert_ffn, m.shared_expert_gate) == (20480, True)
    assert m.shared_expert_params == 3 * h * 20480 + h
    assert m.expert_params == 3 * h * 2560
    # 28 MoE layers x (64 experts + shared) + attention + embeddings, nothing dense.
    assert m.num_dense_layers == 0
    expected = 28 * (m.attn_params_per_layer + 64 * m.expert_params + m.shared_expert_params)
    assert m.total_params == pytest.approx(expected + 2 * 151936 * h)


def test_mtp_layers_are_counted_apart_from_the_decoder() -> None:
    m = spec("deepseek-v3")
    h = 7168
    per_layer = m.attn_params_per_layer + 256 * m.expert_params + m.shared_expert_params
    assert m.mtp_params == pytest.approx(per_layer + 2 * h * h)
    assert m.mtp_active_params == pytest.approx(
        m.attn_params_per_layer + 8 * m.expert_params + m.shared_expert_params + 2 * h * h
    )
    # DeepSeek-V3: 671B + 14B MTP module = 685B on the hub; the module's embedding and head
    # (2 x 129280 x 7168 = 1.85B) are stored again with it but shared here.
    assert (m.total_params + m.mtp_params + 2 * 129280 * h) / 1e9 == pytest.approx(685, rel=0.02)
    assert spec("glm-4.7").mtp_layers == 1 and spec("kimi-k2-instruct").mtp_params == 0


def test_deepseek_v32_indexer() -> None:
    v3, v32 = spec("deepseek-v3"), spec("deepseek-v3.2")
    assert (v32.index_heads, v32.index_head_dim, v32.index_topk) == (64, 128, 2048)
    assert v32.kv_elements_per_token_per_layer == 512 + 64 + 128
    index_params = 1536 * 64 * 128 + 7168 * 128 + 7168 * 64
    assert v32.attn_params_per_layer - v3.attn_params_per_layer == index_params
    # Sparse attention reads 2048 positions' latents and every position's index key.
    assert v32.attended_positions(32768) == 2048 and v32.attended_positions(1000) == 1000
    assert v32.kv_read_elements_per_token_per_layer(32768) == 2048 * 576 + 32768 * 128
    core = 2.0 * 128 * (2 * 512 + 64) * 2048 + 2.0 * 64 * 128 * 32768
    assert v32.attn_core_flops_per_token(32768, decode=True) == pytest.approx(core)
    assert v32.attn_core_flops_per_token(32768, decode=True) < v3.attn_core_flops_per_token(
        32768, decode=True
    )


def test_gpt_oss_alternates_sliding_window_layers() -> None:
    m = spec("gpt-oss-120b")
    assert m.attention_window == 128 and m.windowed_layers == tuple(range(0, 36, 2))
    assert m.expert_dtype == "mxfp4" and m.weight_dtype == "bf16"
    kv = 2 * 8 * 64
    assert m.attended_positions(4096) == (18 * 128 + 18 * 4096) / 36
    assert m.kv_cache_elements_per_token(4096) == pytest.approx((18 * 128 / 4096 + 18) * kv)
    assert m.kv_cache_elements_per_token(100) == 36 * kv  # shorter than the window


def test_the_cost_model_reads_only_the_window_of_windowed_layers() -> None:
    """gpt-oss at a 32k context: the sliding layers keep and read 128 positions, so the KV
    cache and the decode attention core are about half of the all-full-attention model's."""
    m = spec("gpt-oss-120b")
    full = replace(m, attention_window=0, windowed_layers=())
    f = fleet([("h200-0", "H200-SXM-141GB", 2, None)])
    tables = [build_cost_table(f, x, workload(x, context=32768)) for x in (m, full)]
    windowed, plain = tables
    ratio = (18 * 128 / 32768 + 18) / 36
    assert windowed.kv_bytes_per_token == pytest.approx(plain.kv_bytes_per_token * ratio)
    core_w, core_p = (t.gpus[0].attn_core_us_per_token for t in tables)
    assert core_w == pytest.approx(core_p * ratio, rel=1e-9)


def test_llama4_interleaves_moe_and_nests_its_text_config() -> None:
    mav, scout = spec("llama-4-maverick-17b-128e-instruct"), spec("llama-4-scout-17b-16e-instruct")
    assert mav.moe_layers == tuple(range(1, 48, 2)) and scout.moe_layers == tuple(range(48))
    assert (mav.expert_ffn, mav.dense_ffn, mav.shared_expert_params) == (
        8192,
        16384,
        3 * 5120 * 8192,
    )
    # Chunked attention (8192) on the RoPE layers; every fourth layer is global.
    assert mav.attention_window == 8192 and 3 not in mav.windowed_layers
    assert len(mav.windowed_layers) == 36


def test_glm_first_dense_layers_and_shared_expert() -> None:
    m = spec("glm-4.7")
    assert m.moe_layers == tuple(range(3, 92)) and m.num_dense_layers == 3
    assert (m.num_kv_heads, m.head_dim, m.dense_ffn) == (8, 128, 12288)
    assert m.shared_expert_params == 3 * 5120 * 1536


#: ERNIE 4.5 MoE: no public copy of a published config.json was found. These are the
#: defaults of transformers' ``Ernie4_5_MoeConfig`` (huggingface/transformers
#: src/transformers/models/ernie4_5_moe/configuration_ernie4_5_moe.py, documented as "similar
#: to baidu/ERNIE-4.5-21B-A3B-PT"); PaddlePaddle/ERNIE's pre-training config
#: examples/pre-training/model_configs/ERNIE-4p5-21B-A3B/model_config.json agrees (30 layers
#: with ``remove_tail_layer: 2``).
ERNIE_21B_DEFAULTS: dict[str, Any] = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "vocab_size": 103424,
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "num_hidden_layers": 28,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
    "moe_intermediate_size": 1536,
    "moe_k": 6,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": -1,
    "moe_layer_interval": 1,
}


def test_ernie_moe_layers_and_shared_experts() -> None:
    m = from_hf_config(ERNIE_21B_DEFAULTS, "ernie-4.5-21b-a3b")
    assert m.family == "ernie4_5_moe" and m.moe_layers == tuple(range(1, 28))
    assert (m.num_experts, m.top_k, m.num_shared_experts) == (64, 6, 2)
    assert m.shared_expert_params == 3 * 2560 * 1536 * 2
    assert m.total_params / 1e9 == pytest.approx(21, rel=0.05)  # 21B-A3B
    assert m.active_params / 1e9 == pytest.approx(3, rel=0.15)
    every_other = {**ERNIE_21B_DEFAULTS, "moe_layer_start_index": 3, "moe_layer_interval": 2}
    assert from_hf_config(every_other, "e").moe_layers == tuple(range(3, 28, 2))


@pytest.mark.parametrize(
    ("cfg", "needles"),
    [
        (
            {"architectures": ["MiniMaxM1ForCausalLM"], "model_type": "minimax_m1"},
            ("lightning (linear) attention", "kind: Model", "docs/models.md"),
        ),
        (
            {"architectures": ["HunYuanMoEV1ForCausalLM"], "model_type": "hunyuan_v1_moe"},
            ("no reader", "HunYuanMoEV1ForCausalLM", "Qwen2MoeForCausalLM", "kind: Model"),
        ),
    ],
)
def test_unsupported_architectures_say_what_is_missing(
    cfg: dict[str, Any], needles: tuple[str, ...]
) -> None:
    with pytest.raises(InputError) as info:
        from_hf_config({**cfg, "num_hidden_layers": 2, "hidden_size": 64}, "x")
    for needle in needles:
        assert needle in str(info.value)
    assert info.value.field == "architectures"


def test_a_missing_field_is_named() -> None:
    cfg = load("qwen2-57b-a14b")
    del cfg["moe_intermediate_size"]
    with pytest.raises(InputError, match="lacks 'moe_intermediate_size'"):
        from_hf_config(cfg, "q")


# -------------------------------------------------------------------- Model files

QWEN3_30B_FILE: dict[str, Any] = {
    "apiVersion": "mixfleet.io/v1alpha1",
    "kind": "Model",
    "metadata": {"name": "qwen3-30b-a3b"},
    "spec": {
        "family": "qwen3_moe",
        "numLayers": 48,
        "hiddenSize": 2048,
        "vocabSize": 151936,
        "attention": "gqa",
        "queryHeads": 32,
        "kvHeads": 4,
        "headDim": 128,
        "experts": 128,
        "topK": 8,
        "expertFfn": 768,
        "denseFfn": 6144,
    },
}


def test_a_model_file_describes_the_same_model() -> None:
    from_file = from_hf_config(QWEN3_30B_FILE)
    assert from_file == from_hf_config(load("qwen3-30b-a3b"), "qwen3-30b-a3b")


def test_a_model_file_is_strict() -> None:
    bad = {**QWEN3_30B_FILE, "spec": {**QWEN3_30B_FILE["spec"], "expert_ffn": 768}}
    with pytest.raises(InputError, match="did you mean 'expertFfn'") as info:
        from_hf_config(bad)
    assert info.value.field == "spec.expert_ffn"
    dense_gap = {**QWEN3_30B_FILE, "spec": {**QWEN3_30B_FILE["spec"], "firstDenseLayers": 2}}
    del dense_gap["spec"]["denseFfn"]
    with pytest.raises(InputError, match="dense layers"):
        from_hf_config(dense_gap)


def test_a_deployment_carries_a_published_config_to_the_controller() -> None:
    """``spec.modelConfig`` (the CR) / ``model_config_json`` (the wire) hold the config.json
    as published; the controller resolves it with the same reader."""
    spec = DeploymentSpec(name="k2", model="", model_config=load("kimi-k2-instruct"))
    received = spec_from_proto(spec_to_proto(spec))
    assert resolve_model(received) == from_hf_config(load("kimi-k2-instruct"), "k2")
    bad = DeploymentSpec(
        name="m1", model="", model_config={"architectures": ["MiniMaxM1ForCausalLM"]}
    )
    with pytest.raises(InputError, match="lightning") as info:
        resolve_model(bad)
    assert info.value.field == "spec.modelConfig.architectures"


# ------------------------------------------------------------------------- CLI


def _solve(capsys: pytest.CaptureFixture[str], config: Path, *extra: str) -> tuple[int, str, str]:
    code = main(
        [
            "plan",
            "solve",
            "--fleet",
            str(REPO / "examples" / "fleets" / "mixed-24.yaml"),
            "--model-config",
            str(config),
            "--policy",
            "greedy",
            "-q",
            "-o",
            "json",
            *extra,
        ]
    )
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("fixture", "directory", "layers", "experts"),
    [
        ("kimi-k2-instruct", "Kimi-K2-Instruct", 60, 384),
        ("qwen2-57b-a14b", "Qwen2-57B-A14B", 28, 64),
    ],
)
def test_plan_solve_reads_a_published_config_json(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    fixture: str,
    directory: str,
    layers: int,
    experts: int,
) -> None:
    path = tmp_path / directory / "config.json"
    path.parent.mkdir()
    path.write_text((FIXTURES / f"{fixture}.json").read_text())
    code, out, err = _solve(capsys, path, "--engine", "sglang")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["model"] == directory and len(doc["moe_layers"]) == layers
    assert doc["summary"]["feasible"] and doc["engine"]["name"] == "sglang"
    placed = {e for gpu in doc["gpus"] for layer in gpu["experts"] for e, _share in layer}
    assert placed == set(range(experts))  # every routed expert has a slot


def test_plan_solve_refuses_an_unsupported_architecture_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"architectures": ["MiniMaxM1ForCausalLM"], "num_hidden_layers": 80})
    )
    code, _, err = _solve(capsys, path)
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "lightning (linear) attention" in lines[0] and "kind: Model" in lines[0]
