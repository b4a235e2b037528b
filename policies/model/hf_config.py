"""Hugging Face ``config.json`` documents read into the fields of a model.

:func:`model_fields` turns a published ``config.json`` into the keyword arguments of
:class:`policies.model.architecture.ModelSpec`. The reader is chosen by the config's ``architectures``
(the engine's model class: Kimi K2 ships ``model_type: kimi_k2`` with
``DeepseekV3ForCausalLM``) and, when no architecture is known, by ``model_type``. Unknown
keys are normal in a ``config.json`` and are ignored; only the keys a reader uses are
checked. A model no reader knows is refused with what is missing and how to describe it
instead (a mixfleet Model file, :mod:`policies.model.model_file`).

What is read, per layer: dense-first layers (``first_k_dense_replace``,
``moe_layer_start_index``), interleaved MoE (``interleave_moe_layer_step``,
``decoder_sparse_step``, ``mlp_only_layers``), shared experts (count and width, Qwen2-MoE's
shared-expert gate), MLA or GQA attention, DeepSeek-V3.2's sparse-attention indexer,
sliding-window and chunked-attention layers, and multi-token-prediction layers
(``num_nextn_predict_layers``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from policies.errors import InputError
from policies.limits import MAX_EXPERTS, MAX_LAYERS, MAX_MODEL_DIMENSION, bounded_int

Fields = dict[str, Any]

#: Largest value of a config.json integer (:mod:`policies.limits`); other keys:
#: :data:`~policies.limits.MAX_MODEL_DIMENSION`.
_MAXIMA = {
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "first_k_dense_replace",
            "moe_layer_freq",
            "decoder_sparse_step",
            "interleave_moe_layer_step",
        ),
        MAX_LAYERS,
    ),
    **dict.fromkeys(("num_nextn_predict_layers", "num_mtp_modules", "mtp_transformer_layers"), 16),
    **dict.fromkeys(
        ("n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok"),
        MAX_EXPERTS,
    ),
    **dict.fromkeys(
        (
            "n_shared_experts",
            "n_group",
            "topk_group",
            "k",
            "moe_num_experts",
            "moe_num_shared_experts",
            "moe_k",
        ),
        MAX_EXPERTS,
    ),
    **dict.fromkeys(
        ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"), MAX_LAYERS
    ),
}


def cfg_int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """Integer ``cfg[key]`` (``default`` when absent or null) within its bound.

    Raises:
        InputError: absent without a default, not an integer, or out of range.
    """
    v = cfg.get(key)
    if v is None:
        v = default
    if v is None:
        raise InputError(
            f"config.json lacks {key!r}. To fix: give the model's complete Hugging Face "
            "config.json, as published with its weights",
            field=key,
        )
    return bounded_int(v, key, minimum=0, maximum=_MAXIMA.get(key, MAX_MODEL_DIMENSION))


def cfg_dtype(cfg: Mapping[str, Any], default: str) -> str:
    """Weight dtype: ``fp8`` / ``mxfp4`` from ``quantization_config.quant_method``, else
    ``torch_dtype`` (or ``dtype``), else ``default``."""
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, Mapping) else ""
    if method in ("fp8", "mxfp4"):
        return method
    torch_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or default)
    return {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}.get(torch_dtype, default)


def _layer_list(cfg: Mapping[str, Any], key: str, n_layers: int) -> list[int]:
    """``cfg[key]`` as a list of layer indices below ``n_layers`` (empty when absent)."""
    raw = cfg.get(key) or []
    if not isinstance(raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in raw
    ):
        raise InputError(
            f"must be a list of layer indices from 0 to {n_layers - 1}, got {raw!r:.80}",
            field=key,
        )
    return list(raw)


# ------------------------------------------------------------------------- attention


def _gqa(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """Grouped-query attention: KV heads and head dims; no MLA, no expert groups.

    Raises:
        InputError: bad KV heads or ``head_dim``.
    """
    nkv = cfg_int(cfg, "num_key_value_heads", base["num_q_heads"])
    head_dim = cfg.get("head_dim") or base["hidden"] // base["num_q_heads"]
    bounded_int(head_dim, "head_dim", maximum=MAX_MODEL_DIMENSION)
    if nkv == 0 or base["num_q_heads"] % nkv:
        raise InputError(
            f"must divide num_attention_heads ({base['num_q_heads']}), got {nkv}",
            field="num_key_value_heads",
        )
    return {
        "num_kv_heads": nkv,
        "head_dim": head_dim,
        "v_head_dim": head_dim,
        "attention": "gqa",
        "q_lora_rank": 0,
        "kv_lora_rank": 0,
        "qk_rope_dim": 0,
        "n_group": 1,
        "topk_group": 1,
    }


def _mla(cfg: Mapping[str, Any]) -> Fields:
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2) and DeepSeek-V3.2's indexer
    (``index_n_heads`` x ``index_head_dim``, attending to ``index_topk`` positions)."""
    nope, rope = cfg_int(cfg, "qk_nope_head_dim"), cfg_int(cfg, "qk_rope_head_dim")
    return {
        "num_kv_heads": 1,
        "head_dim": nope + rope,
        "v_head_dim": cfg_int(cfg, "v_head_dim"),
        "attention": "mla",
        "q_lora_rank": cfg_int(cfg, "q_lora_rank", 0),
        "kv_lora_rank": cfg_int(cfg, "kv_lora_rank"),
        "qk_rope_dim": rope,
        "n_group": cfg_int(cfg, "n_group", 1) or 1,
        "topk_group": cfg_int(cfg, "topk_group", 1) or 1,
        "index_heads": cfg_int(cfg, "index_n_heads", 0),
        "index_head_dim": cfg_int(cfg, "index_head_dim", 0),
        "index_topk": cfg_int(cfg, "index_topk", 0),
    }


def _windows(cfg: Mapping[str, Any], n_layers: int) -> Fields:
    """Layers that attend to a bounded window: ``layer_types`` ``sliding_attention`` with
    ``sliding_window`` (gpt-oss), Qwen's ``use_sliding_window`` from ``max_window_layers``
    on, Llama 4's chunked attention (``attention_chunk_size``) on its RoPE layers."""
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    layers: tuple[int, ...] = ()
    if isinstance(types, list) and window:
        layers = tuple(i for i, t in enumerate(types[:n_layers]) if t == "sliding_attention")
    elif cfg.get("use_sliding_window") and window:
        start = cfg_int(cfg, "max_window_layers", 0)
        layers = tuple(range(start, n_layers))
    elif cfg.get("attention_chunk_size"):
        window = cfg["attention_chunk_size"]
        rope = cfg.get("no_rope_layers")  # 1 = RoPE layer (chunked), 0 = global NoPE layer
        if not isinstance(rope, list) or len(rope) != n_layers:
            rope = [int((i + 1) % 4 != 0) for i in range(n_layers)]  # transformers' default
        layers = tuple(i for i, r in enumerate(rope) if r)
    if not layers:
        return {}
    size = bounded_int(window, "sliding_window", maximum=MAX_MODEL_DIMENSION)
    return {"attention_window": size, "windowed_layers": layers}


# ------------------------------------------------------------------------ per family


def _deepseek(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """DeepSeek V2/V3/V3.2, Kimi K2: MLA; dense layers before ``first_k_dense_replace``,
    then a MoE layer every ``moe_layer_freq``; shared experts as wide as routed ones;
    ``num_nextn_predict_layers`` MTP layers."""
    n = base["num_layers"]
    dense_k = cfg_int(cfg, "first_k_dense_replace", 0)
    freq = cfg_int(cfg, "moe_layer_freq", 1) or 1
    dtype = cfg_dtype(cfg, "bf16")
    return {
        **_mla(cfg),
        "moe_layers": tuple(i for i in range(dense_k, n) if (i - dense_k) % freq == 0),
        "num_experts": cfg_int(cfg, "n_routed_experts"),
        "num_shared_experts": cfg_int(cfg, "n_shared_experts", 0),
        "top_k": cfg_int(cfg, "num_experts_per_tok"),
        "expert_ffn": cfg_int(cfg, "moe_intermediate_size"),
        "dense_ffn": cfg_int(cfg, "intermediate_size"),
        "weight_dtype": dtype,
        "expert_dtype": dtype,
        "mtp_layers": cfg_int(cfg, "num_nextn_predict_layers", 0),
    }


def _glm4_moe(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """GLM-4.5 / 4.6 / 4.7: GQA, ``first_k_dense_replace`` dense layers, routed and shared
    experts of ``moe_intermediate_size``, ``num_nextn_predict_layers`` MTP layers."""
    n = base["num_layers"]
    dense_k = cfg_int(cfg, "first_k_dense_replace", 0)
    dtype = cfg_dtype(cfg, "bf16")
    return {
        **_gqa(cfg, base),
        "moe_layers": tuple(range(dense_k, n)),
        "num_experts": cfg_int(cfg, "n_routed_experts"),
        "num_shared_experts": cfg_int(cfg, "n_shared_experts", 0),
        "top_k": cfg_int(cfg, "num_experts_per_tok"),
        "expert_ffn": cfg_int(cfg, "moe_intermediate_size"),
        "dense_ffn": cfg_int(cfg, "intermediate_size"),
        "n_group": cfg_int(cfg, "n_group", 1) or 1,
        "topk_group": cfg_int(cfg, "topk_group", 1) or 1,
        "weight_dtype": dtype,
        "expert_dtype": dtype,
        "mtp_layers": cfg_int(cfg, "num_nextn_predict_layers", 0),
    }


def _qwen_moe(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """Qwen2-MoE and Qwen3-MoE: a MoE layer every ``decoder_sparse_step`` layers except
    ``mlp_only_layers``. Qwen2-MoE adds one shared expert of
    ``shared_expert_intermediate_size`` behind a sigmoid gate (Qwen3-MoE has none)."""
    n = base["num_layers"]
    step = cfg_int(cfg, "decoder_sparse_step", 1) or 1
    dense_only = set(_layer_list(cfg, "mlp_only_layers", n))
    shared_ffn = cfg_int(cfg, "shared_expert_intermediate_size", 0)
    dtype = cfg_dtype(cfg, "bf16")
    return {
        **_gqa(cfg, base),
        "moe_layers": tuple(i for i in range(n) if i not in dense_only and (i + 1) % step == 0),
        "num_experts": cfg_int(cfg, "num_experts"),
        "num_shared_experts": 1 if shared_ffn else 0,
        "shared_expert_ffn": shared_ffn,
        "shared_expert_gate": bool(shared_ffn) and base["family"] == "qwen2_moe",
        "top_k": cfg_int(cfg, "num_experts_per_tok"),
        "expert_ffn": cfg_int(cfg, "moe_intermediate_size"),
        "dense_ffn": cfg_int(cfg, "intermediate_size"),
        "weight_dtype": dtype,
        "expert_dtype": dtype,
    }


def _mixtral(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """Mixtral: every layer MoE, experts as wide as ``intermediate_size``."""
    dtype = cfg_dtype(cfg, "bf16")
    ffn = cfg_int(cfg, "intermediate_size")
    return {
        **_gqa(cfg, base),
        "moe_layers": tuple(range(base["num_layers"])),
        "num_experts": cfg_int(cfg, "num_local_experts"),
        "num_shared_experts": 0,
        "top_k": cfg_int(cfg, "num_experts_per_tok"),
        "expert_ffn": ffn,
        "dense_ffn": ffn,
        "weight_dtype": dtype,
        "expert_dtype": dtype,
    }


def _gpt_oss(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """gpt-oss: every layer MoE; attention in BF16, experts MXFP4; alternating
    sliding-window (``layer_types``) and full-attention layers."""
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    ffn = cfg_int(cfg, "intermediate_size")
    return {
        **_gqa(cfg, base),
        "moe_layers": tuple(range(base["num_layers"])),
        "num_experts": cfg_int(cfg, "num_local_experts"),
        "num_shared_experts": 0,
        "top_k": cfg_int({"k": top_k}, "k"),
        "expert_ffn": ffn,
        "dense_ffn": ffn,
        "weight_dtype": "bf16",
        "expert_dtype": cfg_dtype(cfg, "bf16"),
    }


def _llama4(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """Llama 4 (text model): a MoE layer every ``interleave_moe_layer_step`` layers (or the
    listed ``moe_layers``), one shared expert as wide as the routed ones
    (``intermediate_size``), dense layers of ``intermediate_size_mlp``."""
    n = base["num_layers"]
    step = cfg_int(cfg, "interleave_moe_layer_step", 1) or 1
    listed = _layer_list(cfg, "moe_layers", n)
    moe = tuple(listed) if listed else tuple(range(step - 1, n, step))
    dtype = cfg_dtype(cfg, "bf16")
    return {
        **_gqa(cfg, base),
        "moe_layers": moe,
        "num_experts": cfg_int(cfg, "num_local_experts"),
        "num_shared_experts": 1,
        "top_k": cfg_int(cfg, "num_experts_per_tok"),
        "expert_ffn": cfg_int(cfg, "intermediate_size"),
        "dense_ffn": cfg_int(cfg, "intermediate_size_mlp"),
        "weight_dtype": dtype,
        "expert_dtype": dtype,
    }


def _minimax_m2(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """MiniMax-M2: full attention (GQA) in every layer, every layer MoE with experts of
    ``intermediate_size``, ``shared_intermediate_size`` shared width (0: none), and
    ``num_mtp_modules`` x ``mtp_transformer_layers`` MTP layers when ``use_mtp``."""
    dtype = cfg_dtype(cfg, "bf16")
    shared_ffn = cfg_int(cfg, "shared_intermediate_size", 0)
    mtp = 0
    if cfg.get("use_mtp"):
        mtp = cfg_int(cfg, "num_mtp_modules", 0) * cfg_int(cfg, "mtp_transformer_layers", 1)
    ffn = cfg_int(cfg, "intermediate_size")
    return {
        **_gqa(cfg, base),
        "moe_layers": tuple(range(base["num_layers"])),
        "num_experts": cfg_int(cfg, "num_local_experts"),
        "num_shared_experts": 1 if shared_ffn else 0,
        "shared_expert_ffn": shared_ffn,
        "top_k": cfg_int(cfg, "num_experts_per_tok"),
        "expert_ffn": ffn,
        "dense_ffn": ffn,
        "weight_dtype": dtype,
        "expert_dtype": dtype,
        "mtp_layers": mtp,
    }


def _ernie4_5_moe(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """ERNIE 4.5 MoE: MoE layers from ``moe_layer_start_index`` to ``moe_layer_end_index``
    (-1: the last) every ``moe_layer_interval``, ``moe_num_shared_experts`` shared experts of
    ``moe_intermediate_size`` (one MLP that wide, as SGLang's ``ernie4.py`` builds it). Its
    MTP block is a dense layer, not modelled here."""
    n = base["num_layers"]
    start = cfg_int(cfg, "moe_layer_start_index", n)
    end_raw = cfg.get("moe_layer_end_index", -1)
    end = n - 1 if end_raw in (-1, None) else cfg_int(cfg, "moe_layer_end_index")
    step = cfg_int(cfg, "moe_layer_interval", 1) or 1
    dtype = cfg_dtype(cfg, "bf16")
    return {
        **_gqa(cfg, base),
        "moe_layers": tuple(
            i for i in range(start, min(end, n - 1) + 1) if (i - start) % step == 0
        ),
        "num_experts": cfg_int(cfg, "moe_num_experts"),
        "num_shared_experts": cfg_int(cfg, "moe_num_shared_experts", 0),
        "top_k": cfg_int(cfg, "moe_k"),
        "expert_ffn": cfg_int(cfg, "moe_intermediate_size"),
        "dense_ffn": cfg_int(cfg, "intermediate_size"),
        "weight_dtype": dtype,
        "expert_dtype": dtype,
    }


def _llama(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> Fields:
    """Llama: dense, every layer a plain FFN."""
    dtype = cfg_dtype(cfg, "bf16")
    return {
        **_gqa(cfg, base),
        "moe_layers": (),
        "num_experts": 0,
        "num_shared_experts": 0,
        "top_k": 0,
        "expert_ffn": 0,
        "dense_ffn": cfg_int(cfg, "intermediate_size"),
        "weight_dtype": dtype,
        "expert_dtype": dtype,
    }


Reader = Callable[[Mapping[str, Any], Mapping[str, Any]], Fields]

#: family -> (reader, Hugging Face architectures, model_type values).
FAMILIES: dict[str, tuple[Reader, tuple[str, ...], tuple[str, ...]]] = {
    "deepseek_v3": (_deepseek, ("DeepseekV3ForCausalLM",), ("deepseek_v3", "kimi_k2")),
    "deepseek_v2": (_deepseek, ("DeepseekV2ForCausalLM",), ("deepseek_v2",)),
    "deepseek_v32": (_deepseek, ("DeepseekV32ForCausalLM",), ("deepseek_v32",)),
    "qwen3_moe": (_qwen_moe, ("Qwen3MoeForCausalLM",), ("qwen3_moe",)),
    "qwen2_moe": (_qwen_moe, ("Qwen2MoeForCausalLM",), ("qwen2_moe",)),
    "mixtral": (_mixtral, ("MixtralForCausalLM",), ("mixtral",)),
    "gpt_oss": (_gpt_oss, ("GptOssForCausalLM",), ("gpt_oss",)),
    "glm4_moe": (_glm4_moe, ("Glm4MoeForCausalLM",), ("glm4_moe",)),
    "llama4": (
        _llama4,
        ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"),
        ("llama4", "llama4_text"),
    ),
    "minimax_m2": (_minimax_m2, ("MiniMaxM2ForCausalLM",), ("minimax_m2",)),
    "ernie4_5_moe": (_ernie4_5_moe, ("Ernie4_5_MoeForCausalLM",), ("ernie4_5_moe",)),
    "llama": (_llama, ("LlamaForCausalLM",), ("llama",)),
}

#: Architectures (or model_type values) whose layers the cost model has no place for.
UNSUPPORTED: dict[str, str] = {
    "MiniMaxM1ForCausalLM": "lightning (linear) attention layers (attn_type_list)",
    "MiniMaxText01ForCausalLM": "lightning (linear) attention layers (attn_type_list)",
    "minimax_m1": "lightning (linear) attention layers (attn_type_list)",
    "Qwen3NextForCausalLM": "gated DeltaNet linear-attention layers (layer_types)",
    "KimiLinearForCausalLM": "Kimi Delta Attention linear layers (linear_attn_config)",
}

MODEL_FILE_HINT = (
    "To fix: describe the model in a mixfleet Model file and pass it as --model-config "
    "(apiVersion: mixfleet.io/v1alpha1, kind: Model, spec: {numLayers, hiddenSize, "
    "vocabSize, attention, queryHeads, kvHeads, headDim, experts, topK, expertFfn, "
    "denseFfn, ...}; every field in docs/models.md)"
)


def family_of(cfg: Mapping[str, Any]) -> str:
    """The reader family of a config: its first known ``architectures`` entry, else its
    ``model_type``.

    Raises:
        InputError: an architecture the cost model cannot represent (naming what it
            lacks), or one no reader knows (naming the supported ones and the fix).
    """
    archs = cfg.get("architectures") or []
    archs = [str(a) for a in archs] if isinstance(archs, list) else [str(archs)]
    model_type = str(cfg.get("model_type", ""))
    for arch in archs:
        for family, (_, names, _types) in FAMILIES.items():
            if arch in names:
                return family
    for family, (_, _names, types) in FAMILIES.items():
        if model_type in types:
            return family
    shown = f"model_type {model_type!r} (architectures {archs})"
    for key in (*archs, model_type):
        if key in UNSUPPORTED:
            raise InputError(
                f"unsupported {shown}: it has {UNSUPPORTED[key]}, which the cost model "
                f"does not represent. {MODEL_FILE_HINT}, approximating those layers",
                field="architectures",
            )
    known = sorted(a for _, names, _t in FAMILIES.values() for a in names)
    raise InputError(
        f"unsupported {shown}: no reader for it (known architectures: "
        f"{', '.join(known)}). {MODEL_FILE_HINT}",
        field="architectures",
    )


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: ``text_config`` of a multimodal config (Llama 4), with
    the top level's ``architectures`` and quantization, else ``cfg`` itself."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        return cfg
    merged = dict(text)
    for key in ("quantization_config", "torch_dtype"):
        if key in cfg and key not in merged:
            merged[key] = cfg[key]
    return merged


def model_fields(doc: Any, name: str | None = None) -> Fields:
    """The :class:`policies.model.architecture.ModelSpec` keyword arguments of a ``config.json``.

    Raises:
        InputError: not an object, unsupported architecture, missing or malformed field.
    """
    if not isinstance(doc, Mapping):
        raise InputError("config.json must be a JSON object", field="config")
    family = family_of(doc)
    cfg = _text_config(doc)
    n_layers = cfg_int(cfg, "num_hidden_layers")
    hidden = cfg_int(cfg, "hidden_size")
    nh = cfg_int(cfg, "num_attention_heads")
    if n_layers == 0 or hidden == 0 or nh == 0:
        raise InputError("num_hidden_layers, hidden_size and num_attention_heads must be > 0")
    base: Fields = {
        "name": name or str(doc.get("_name_or_path") or family),
        "family": family,
        "num_layers": n_layers,
        "hidden": hidden,
        "vocab": cfg_int(cfg, "vocab_size"),
        "num_q_heads": nh,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
    reader = FAMILIES[family][0]
    return {**base, **reader(cfg, base), **_windows(cfg, n_layers)}
