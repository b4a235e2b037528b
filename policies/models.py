"""Model architectures: presets and Hugging Face ``config.json`` parsing.

Everything the cost model needs about a transformer: layer counts, attention shape, MoE
shape and weight dtypes, with derived parameter, byte and FLOP counts per layer.
Presets are written as Hugging Face configs and go through the same parser as
``--model-config``, so there is one code path (REFERENCE.md section 9).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError
from policies.limits import (
    MAX_EXPERTS,
    MAX_LAYER_EXPERTS,
    MAX_LAYERS,
    MAX_MODEL_DIMENSION,
    bounded_int,
)

#: bytes per weight element; MXFP4 is 4-bit values plus one 8-bit scale per 32 values.
DTYPE_BYTES: dict[str, float] = {"fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "mxfp4": 4.25 / 8}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, dense or Mixture-of-Experts.

    Attributes:
        name: preset or ``config.json`` name.
        family: ``deepseek_v3`` | ``qwen3_moe`` | ``mixtral`` | ``gpt_oss`` | ``llama``.
        num_layers: decoder layers (``num_hidden_layers``).
        moe_layers: indices of the layers whose FFN is a routed MoE (empty for dense).
        hidden: hidden size (elements).
        vocab: vocabulary size.
        num_q_heads, num_kv_heads, head_dim: attention shape (GQA); for MLA num_kv_heads
            is 1 and head_dim is the q/k head dim (nope + rope).
        v_head_dim: value head dim.
        attention: ``gqa`` or ``mla``.
        q_lora_rank, kv_lora_rank, qk_rope_dim: MLA ranks (0 for GQA).
        num_experts: routed experts per MoE layer.
        num_shared_experts: shared experts per MoE layer (computed on every token).
        top_k: routed experts per token.
        expert_ffn: intermediate size of one routed expert.
        dense_ffn: intermediate size of a dense FFN layer.
        n_group, topk_group: DeepSeek group-limited routing (1, 1 when unused).
        weight_dtype: dtype of attention and dense weights (``fp8`` | ``bf16``).
        expert_dtype: dtype of routed-expert weights (``fp8`` | ``bf16`` | ``mxfp4``).
        tie_embeddings: input and output embeddings share weights.
        mtp_layers: multi-token-prediction layers after the decoder (DeepSeek-V3
            ``num_nextn_predict_layers``); layer ``k`` has index ``num_layers + k`` and is an
            MoE layer with the same experts. 0 when the model has none.
    """

    name: str
    family: str
    num_layers: int
    moe_layers: tuple[int, ...]
    hidden: int
    vocab: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    attention: str
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_dim: int
    num_experts: int
    num_shared_experts: int
    top_k: int
    expert_ffn: int
    dense_ffn: int
    n_group: int
    topk_group: int
    weight_dtype: str
    expert_dtype: str
    tie_embeddings: bool = False
    mtp_layers: int = 0

    # ------------------------------------------------------------------ shape helpers
    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers) and self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attn_params_per_layer(self) -> float:
        """Attention projection parameters of one layer."""
        h, nh = self.hidden, self.num_q_heads
        if self.attention == "mla":
            qk = self.head_dim
            q = (
                h * self.q_lora_rank + self.q_lora_rank * nh * qk
                if self.q_lora_rank
                else h * nh * qk
            )
            kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
            kv_b = self.kv_lora_rank * nh * (qk - self.qk_rope_dim + self.v_head_dim)
            o = nh * self.v_head_dim * h
            return float(q + kv_a + kv_b + o)
        return float(
            h * nh * self.head_dim
            + 2 * h * self.num_kv_heads * self.head_dim
            + nh * self.head_dim * h
        )

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        """KV-cache elements one token keeps per layer (MLA keeps the compressed latent)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.num_kv_heads * self.head_dim

    def attn_core_flops_per_token(self, context: float, *, decode: bool) -> float:
        """Score and value FLOPs per token per layer attending over ``context`` positions.

        MLA in decode uses weight absorption (queries in the latent space), as SGLang and
        FlashMLA do; prefill uses the expanded heads.
        """
        nh = self.num_q_heads
        if self.attention == "mla" and decode:
            return 2.0 * nh * (2 * self.kv_lora_rank + self.qk_rope_dim) * context
        return 2.0 * nh * (self.head_dim + self.v_head_dim) * context

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (gate, up, down)."""
        return 3.0 * self.hidden * self.expert_ffn

    @property
    def shared_expert_params(self) -> float:
        return 3.0 * self.hidden * self.expert_ffn * self.num_shared_experts

    @property
    def dense_ffn_params(self) -> float:
        return 3.0 * self.hidden * self.dense_ffn

    @property
    def embedding_params(self) -> float:
        return float(self.vocab * self.hidden * (1 if self.tie_embeddings else 2))

    @property
    def weight_bytes(self) -> float:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def expert_bytes(self) -> float:
        """Bytes of one routed expert's weights."""
        return self.expert_params * DTYPE_BYTES[self.expert_dtype]

    @property
    def total_params(self) -> float:
        return (
            self.num_layers * self.attn_params_per_layer
            + self.num_dense_layers * self.dense_ffn_params
            + self.num_moe_layers
            * (self.num_experts * self.expert_params + self.shared_expert_params)
            + self.embedding_params
        )

    @property
    def active_params(self) -> float:
        """Parameters used per token."""
        return (
            self.num_layers * self.attn_params_per_layer
            + self.num_dense_layers * self.dense_ffn_params
            + self.num_moe_layers * (self.top_k * self.expert_params + self.shared_expert_params)
            + self.embedding_params / (1 if self.tie_embeddings else 2)
        )


# ---------------------------------------------------------------------- HF configs


#: Largest value of a config.json integer (:mod:`policies.limits`); other keys:
#: :data:`~policies.limits.MAX_MODEL_DIMENSION`.
_MAXIMA = {
    **dict.fromkeys(
        ("num_hidden_layers", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step"),
        MAX_LAYERS,
    ),
    "num_nextn_predict_layers": 16,
    **dict.fromkeys(
        ("n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok"),
        MAX_EXPERTS,
    ),
    **dict.fromkeys(("n_shared_experts", "n_group", "topk_group", "k"), MAX_EXPERTS),
}


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise InputError(
            f"config.json lacks {key!r}. To fix: give a complete Hugging Face config.json",
            field=key,
        )
    return bounded_int(v, key, minimum=0, maximum=_MAXIMA.get(key, MAX_MODEL_DIMENSION))


def _dtype(cfg: Mapping[str, Any], default: str) -> str:
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, Mapping) else ""
    if method == "fp8":
        return "fp8"
    if method == "mxfp4":
        return "mxfp4"
    torch_dtype = str(cfg.get("torch_dtype", cfg.get("dtype", default)))
    return {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}.get(torch_dtype, default)


_FAMILIES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "gpt_oss", "llama")


def from_hf_config(cfg: Any, name: str | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from a Hugging Face ``config.json`` document.

    Supported ``model_type``: deepseek_v3 (and v2), qwen3_moe, mixtral, gpt_oss, llama.

    Raises:
        InputError: unsupported family, missing or malformed field.
    """
    if not isinstance(cfg, Mapping):
        raise InputError("config.json must be a JSON object", field="config")
    family = str(cfg.get("model_type", ""))
    if family not in _FAMILIES:
        raise InputError(
            f"unsupported model_type {family!r}. To fix: use a config.json of one of "
            f"{', '.join(_FAMILIES)}, or a preset (mixfleetctl model list)",
            field="model_type",
        )
    n_layers = _int(cfg, "num_hidden_layers")
    hidden = _int(cfg, "hidden_size")
    nh = _int(cfg, "num_attention_heads")
    vocab = _int(cfg, "vocab_size")
    tie = bool(cfg.get("tie_word_embeddings", False))
    label = name or str(cfg.get("_name_or_path", family))
    if n_layers == 0 or hidden == 0 or nh == 0:
        raise InputError("num_hidden_layers, hidden_size and num_attention_heads must be > 0")
    base: dict[str, Any] = {
        "name": label,
        "family": family,
        "num_layers": n_layers,
        "hidden": hidden,
        "vocab": vocab,
        "num_q_heads": nh,
        "tie_embeddings": tie,
    }
    if family in ("deepseek_v3", "deepseek_v2"):
        return _checked_size(_deepseek_spec(cfg, base))
    common = _gqa_common(cfg, base)
    build = {
        "llama": _llama_spec,
        "qwen3_moe": _qwen3_moe_spec,
        "mixtral": _mixtral_spec,
        "gpt_oss": _gpt_oss_spec,
    }[family]
    return _checked_size(build(cfg, common))


def _checked_size(spec: ModelSpec) -> ModelSpec:
    """``spec`` when its (MoE layer, expert) table is within
    :data:`~policies.limits.MAX_LAYER_EXPERTS` and it routes to no more experts than it has.

    Raises:
        InputError: naming the limit.
    """
    cells = len(spec.moe_layers) * spec.num_experts
    if cells > MAX_LAYER_EXPERTS:
        raise InputError(
            f"{len(spec.moe_layers):,} MoE layers x {spec.num_experts:,} experts = {cells:,} "
            f"(layer, expert) pairs, over the limit of {MAX_LAYER_EXPERTS:,}. To fix: check "
            "num_hidden_layers and the expert count",
            field="num_hidden_layers",
        )
    if spec.moe_layers and not 0 < spec.top_k <= spec.num_experts:
        raise InputError(
            f"must be from 1 to the {spec.num_experts} routed experts, got {spec.top_k}",
            field="num_experts_per_tok",
        )
    return spec


def _deepseek_spec(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> ModelSpec:
    """DeepSeek V3 / V2: MLA attention, dense layers before ``first_k_dense_replace``,
    then a MoE layer every ``moe_layer_freq`` layers.

    Args:
        cfg: the ``config.json`` document.
        base: the fields every family shares (name, family, layers, hidden size, vocab,
            query heads, tied embeddings), already read from ``cfg``.
    """
    n_layers = base["num_layers"]
    dense_k = _int(cfg, "first_k_dense_replace", 0)
    freq = _int(cfg, "moe_layer_freq", 1) or 1
    nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
    moe = tuple(i for i in range(dense_k, n_layers) if (i - dense_k) % freq == 0)
    dtype = _dtype(cfg, "bf16")
    return ModelSpec(
        **base,
        moe_layers=moe,
        num_kv_heads=1,
        head_dim=nope + rope,
        v_head_dim=_int(cfg, "v_head_dim"),
        attention="mla",
        q_lora_rank=_int(cfg, "q_lora_rank", 0) if cfg.get("q_lora_rank") else 0,
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        qk_rope_dim=rope,
        num_experts=_int(cfg, "n_routed_experts"),
        num_shared_experts=_int(cfg, "n_shared_experts", 0),
        top_k=_int(cfg, "num_experts_per_tok"),
        expert_ffn=_int(cfg, "moe_intermediate_size"),
        dense_ffn=_int(cfg, "intermediate_size"),
        n_group=_int(cfg, "n_group", 1) or 1,
        topk_group=_int(cfg, "topk_group", 1) or 1,
        weight_dtype=dtype,
        expert_dtype=dtype,
        mtp_layers=_int(cfg, "num_nextn_predict_layers", 0),
    )


def _gqa_common(cfg: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The fields the grouped-query-attention families (llama, qwen3_moe, mixtral,
    gpt_oss) share: ``base`` plus KV heads and head dimensions, no MLA, no expert groups.

    Raises:
        InputError: missing KV heads or a non-integer ``head_dim``.
    """
    nkv = _int(cfg, "num_key_value_heads", base["num_q_heads"])
    head_dim = cfg.get("head_dim") or base["hidden"] // base["num_q_heads"]
    bounded_int(head_dim, "head_dim", maximum=MAX_MODEL_DIMENSION)
    return {
        **base,
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


def _llama_spec(cfg: Mapping[str, Any], common: Mapping[str, Any]) -> ModelSpec:
    """Llama: dense, every layer a plain FFN."""
    dtype = _dtype(cfg, "bf16")
    return ModelSpec(
        **common,
        moe_layers=(),
        num_experts=0,
        num_shared_experts=0,
        top_k=0,
        expert_ffn=0,
        dense_ffn=_int(cfg, "intermediate_size"),
        weight_dtype=dtype,
        expert_dtype=dtype,
    )


def _qwen3_moe_spec(cfg: Mapping[str, Any], common: Mapping[str, Any]) -> ModelSpec:
    """Qwen3 MoE: a MoE layer every ``decoder_sparse_step`` layers except ``mlp_only_layers``."""
    step = _int(cfg, "decoder_sparse_step", 1) or 1
    dense_raw = cfg.get("mlp_only_layers") or []
    if not isinstance(dense_raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense_raw
    ):
        raise InputError(
            f"must be a list of layer indices, got {dense_raw!r:.80}", field="mlp_only_layers"
        )
    dense_only = set(dense_raw)
    n_layers = common["num_layers"]
    moe = tuple(i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0)
    dtype = _dtype(cfg, "bf16")
    return ModelSpec(
        **common,
        moe_layers=moe,
        num_experts=_int(cfg, "num_experts"),
        num_shared_experts=0,
        top_k=_int(cfg, "num_experts_per_tok"),
        expert_ffn=_int(cfg, "moe_intermediate_size"),
        dense_ffn=_int(cfg, "intermediate_size"),
        weight_dtype=dtype,
        expert_dtype=dtype,
    )


def _mixtral_spec(cfg: Mapping[str, Any], common: Mapping[str, Any]) -> ModelSpec:
    """Mixtral: every layer MoE, experts as wide as ``intermediate_size``."""
    dtype = _dtype(cfg, "bf16")
    ffn = _int(cfg, "intermediate_size")
    return ModelSpec(
        **common,
        moe_layers=tuple(range(common["num_layers"])),
        num_experts=_int(cfg, "num_local_experts"),
        num_shared_experts=0,
        top_k=_int(cfg, "num_experts_per_tok"),
        expert_ffn=ffn,
        dense_ffn=ffn,
        weight_dtype=dtype,
        expert_dtype=dtype,
    )


def _gpt_oss_spec(cfg: Mapping[str, Any], common: Mapping[str, Any]) -> ModelSpec:
    """gpt-oss: every layer MoE; attention in BF16, experts MXFP4."""
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    ffn = _int(cfg, "intermediate_size")
    return ModelSpec(
        **common,
        moe_layers=tuple(range(common["num_layers"])),
        num_experts=_int(cfg, "num_local_experts"),
        num_shared_experts=0,
        top_k=_int({"k": top_k}, "k"),
        expert_ffn=ffn,
        dense_ffn=ffn,
        weight_dtype="bf16",
        expert_dtype=_dtype(cfg, "bf16"),
    )


# ------------------------------------------------------------------------- presets

_PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "vocab_size": 129280,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "quantization_config": {"quant_method": "fp8"},
        "tie_word_embeddings": False,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 94,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    },
    "gpt-oss-120b": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 36,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "intermediate_size": 2880,
        "vocab_size": 201088,
        "quantization_config": {"quant_method": "mxfp4"},
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-70b": {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
}

PRESETS: dict[str, ModelSpec] = {k: from_hf_config(v, k) for k, v in _PRESET_CONFIGS.items()}


def preset(name: str) -> ModelSpec:
    """Look up a preset by name (case-insensitive).

    Raises:
        InputError: unknown preset, listing the known ones.
    """
    spec = PRESETS.get(name.strip().lower())
    if spec is None:
        raise InputError(
            f"unknown model preset {name!r}. To fix: use one of {', '.join(PRESETS)} or "
            "--model-config PATH to a Hugging Face config.json",
            field="model",
        )
    return spec
