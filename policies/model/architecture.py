"""Model architectures: presets and Hugging Face ``config.json`` parsing.

Everything the cost model needs about a transformer: layer counts, attention shape, MoE
shape and weight dtypes, with derived parameter, byte and FLOP counts per layer.
Presets are written as Hugging Face configs and go through the same parser as
``--model-config``, so there is one code path (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError
from policies.limits import MAX_LAYER_EXPERTS
from policies.model.hf_config import model_fields

#: bytes per weight element; MXFP4 is 4-bit values plus one 8-bit scale per 32 values.
DTYPE_BYTES: dict[str, float] = {"fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "mxfp4": 4.25 / 8}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, dense or Mixture-of-Experts.

    Attributes:
        name: preset or ``config.json`` name.
        family: the engine model class it maps to (:data:`policies.model.hf_config.FAMILIES`):
            ``deepseek_v3`` (also Kimi K2), ``deepseek_v32``, ``qwen3_moe``, ``qwen2_moe``,
            ``mixtral``, ``gpt_oss``, ``glm4_moe``, ``llama4``, ``minimax_m2``, ``ernie4_5_moe``,
            ``llama``; ``custom`` from a Model file.
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
        shared_expert_ffn: intermediate size of one shared expert; 0 means as wide as a
            routed expert (``expert_ffn``). Qwen2-MoE: ``shared_expert_intermediate_size``.
        shared_expert_gate: the shared expert's output passes a sigmoid gate
            (``Linear(hidden, 1)``, Qwen2-MoE).
        attention_window: positions a windowed layer attends to (gpt-oss sliding window,
            Llama 4 attention chunk), tokens; 0 when every layer attends to the whole context.
        windowed_layers: indices of the layers with that window.
        index_heads, index_head_dim, index_topk: DeepSeek-V3.2 sparse-attention indexer
            (heads, head dim, positions each query attends to); 0 without one.
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
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    attention_window: int = 0
    windowed_layers: tuple[int, ...] = ()
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

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
            # DeepSeek-V3.2 indexer: wq_b (q latent -> heads x dim), wk, weights_proj.
            ih, idim = self.index_heads, self.index_head_dim
            index = (self.q_lora_rank or h) * ih * idim + h * idim + h * ih
            return float(q + kv_a + kv_b + o + index)
        return float(
            h * nh * self.head_dim
            + 2 * h * self.num_kv_heads * self.head_dim
            + nh * self.head_dim * h
        )

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        """KV-cache elements one token keeps per layer (MLA keeps the compressed latent)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_dim + self.index_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def attended_positions(self, context: float) -> float:
        """Positions one layer's attention core reads per query, averaged over the decoder
        layers: ``context``, at most ``attention_window`` in windowed layers and at most
        ``index_topk`` under DeepSeek-V3.2 sparse attention."""
        full = min(context, self.index_topk) if self.index_topk else context
        if not self.windowed_layers:
            return float(full)
        windowed = len(self.windowed_layers)
        local = min(context, self.attention_window)
        return (windowed * local + (self.num_layers - windowed) * full) / self.num_layers

    def kv_read_elements_per_token_per_layer(self, context: float) -> float:
        """KV-cache elements one decode query reads per layer over ``context`` positions
        (averaged over layers): the attended positions' KV, plus the indexer keys of every
        position under sparse attention."""
        if self.index_topk:
            latent = self.kv_lora_rank + self.qk_rope_dim
            return self.attended_positions(context) * latent + context * self.index_head_dim
        return self.attended_positions(context) * self.kv_elements_per_token_per_layer

    def kv_cache_elements_per_token(self, context: float) -> float:
        """KV-cache elements a sequence of ``context`` tokens keeps per token, all layers
        together (windowed layers keep at most ``attention_window`` positions)."""
        per_layer = self.kv_elements_per_token_per_layer
        if not self.windowed_layers or context <= self.attention_window:
            return self.num_layers * per_layer
        windowed = len(self.windowed_layers)
        kept = windowed * self.attention_window / context + (self.num_layers - windowed)
        return kept * per_layer

    def attn_core_flops_per_token(self, context: float, *, decode: bool) -> float:
        """Score and value FLOPs per token per layer attending over ``context`` positions.

        MLA in decode uses weight absorption (queries in the latent space), as SGLang and
        FlashMLA do; prefill uses the expanded heads.
        """
        nh = self.num_q_heads
        positions = self.attended_positions(context)
        index = 2.0 * self.index_heads * self.index_head_dim * context  # indexer scores
        if self.attention == "mla" and decode:
            return 2.0 * nh * (2 * self.kv_lora_rank + self.qk_rope_dim) * positions + index
        return 2.0 * nh * (self.head_dim + self.v_head_dim) * positions + index

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (gate, up, down)."""
        return 3.0 * self.hidden * self.expert_ffn

    @property
    def shared_expert_params(self) -> float:
        """Parameters of one MoE layer's shared experts (and their gate), computed on every
        token."""
        ffn = self.shared_expert_ffn or self.expert_ffn
        gate = self.hidden if self.shared_expert_gate and self.num_shared_experts else 0
        return 3.0 * self.hidden * ffn * self.num_shared_experts + gate

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
    def mtp_params(self) -> float:
        """Parameters of the multi-token-prediction layers (not in :attr:`total_params`):
        each is an attention layer, an MoE layer with all its routed and shared experts (a
        dense FFN for a dense model) and the ``2 hidden -> hidden`` projection that joins
        the embedding with the last hidden state; embeddings and head are shared."""
        ffn = (
            self.num_experts * self.expert_params + self.shared_expert_params
            if self.is_moe
            else self.dense_ffn_params
        )
        per_layer = self.attn_params_per_layer + ffn + 2.0 * self.hidden * self.hidden
        return self.mtp_layers * per_layer

    @property
    def mtp_active_params(self) -> float:
        """Parameters one MTP draft step uses per token (routed top-k plus shared)."""
        ffn = (
            self.top_k * self.expert_params + self.shared_expert_params
            if self.is_moe
            else self.dense_ffn_params
        )
        per_layer = self.attn_params_per_layer + ffn + 2.0 * self.hidden * self.hidden
        return self.mtp_layers * per_layer

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


def from_hf_config(cfg: Any, name: str | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from a Hugging Face ``config.json`` document, or from a
    mixfleet Model document (``kind: Model``, :mod:`policies.model.model_file`).

    The reader is chosen by ``architectures``, then ``model_type``
    (:data:`policies.model.hf_config.FAMILIES`): DeepSeek V2/V3/V3.2, Kimi K2, Qwen2-MoE,
    Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5/4.6/4.7, Llama 4, MiniMax-M2, Llama.

    Raises:
        InputError: unsupported architecture (naming what is missing and the fix),
            missing or malformed field.
    """
    if isinstance(cfg, Mapping) and cfg.get("kind") == "Model":
        from policies.model.model_file import model_file_fields

        return _checked_size(ModelSpec(**model_file_fields(cfg, name)))
    return _checked_size(ModelSpec(**model_fields(cfg, name)))


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
