"""Small model configs (the fields of the public ``config.json`` of each family, shrunk) that
the conformance tests solve and hand to the engines' own loaders."""

from __future__ import annotations

from typing import Any

DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 5,
    "first_k_dense_replace": 1,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "num_nextn_predict_layers": 1,
    "vocab_size": 32000,
}

DEEPSEEK_MTP: dict[str, Any] = {
    k: v for k, v in DEEPSEEK.items() if k not in ("n_group", "topk_group")
}
"""DeepSeek-V3 shape with its next-token-prediction layer and no group-limited routing."""

QWEN3: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "intermediate_size": 2048,
    "vocab_size": 32000,
}

MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral",
    "num_hidden_layers": 3,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 1024,
    "vocab_size": 32000,
}
