"""A mixfleet Model file: the model described field by field, for an architecture that no
Hugging Face ``config.json`` reader knows (:mod:`policies.model.hf_config`).

Unlike a ``config.json``, a Model file is strict: every key at every level must be known
(:func:`policies.keys.check_keys`). The format (all sizes in elements, counts in layers or
experts)::

    apiVersion: mixfleet.io/v1alpha1
    kind: Model
    metadata: {name: my-moe}
    spec:
      numLayers: 48            # decoder layers
      hiddenSize: 4096
      vocabSize: 151936
      attention: gqa           # gqa | mla
      queryHeads: 32
      kvHeads: 4               # gqa; default queryHeads
      headDim: 128             # default hiddenSize / queryHeads (mla: nope + rope dims)
      experts: 128             # routed experts per MoE layer; 0 or absent: dense model
      topK: 8
      expertFfn: 768           # intermediate size of one routed expert
      sharedExperts: 0
      denseFfn: 6144           # intermediate size of a dense FFN layer
      firstDenseLayers: 0      # or moeLayers: [list of MoE layer indices]

Optional: ``vHeadDim``, ``qLoraRank``, ``kvLoraRank``, ``ropeHeadDim`` (MLA),
``sharedExpertFfn``, ``sharedExpertGate``, ``expertGroups``, ``topkGroups``,
``weightDtype`` / ``expertDtype`` (bf16 | fp16 | fp8 | mxfp4), ``tieEmbeddings``,
``mtpLayers``, ``attentionWindow`` with ``windowedLayers``, ``family``. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.errors import InputError
from policies.keys import check_keys
from policies.limits import MAX_EXPERTS, MAX_LAYERS, MAX_MODEL_DIMENSION, bounded_int

_TOP = ("apiVersion", "kind", "metadata", "spec")
_SPEC_INTS = {
    "numLayers": ("num_layers", MAX_LAYERS),
    "hiddenSize": ("hidden", MAX_MODEL_DIMENSION),
    "vocabSize": ("vocab", MAX_MODEL_DIMENSION),
    "queryHeads": ("num_q_heads", MAX_MODEL_DIMENSION),
    "kvHeads": ("num_kv_heads", MAX_MODEL_DIMENSION),
    "headDim": ("head_dim", MAX_MODEL_DIMENSION),
    "vHeadDim": ("v_head_dim", MAX_MODEL_DIMENSION),
    "qLoraRank": ("q_lora_rank", MAX_MODEL_DIMENSION),
    "kvLoraRank": ("kv_lora_rank", MAX_MODEL_DIMENSION),
    "ropeHeadDim": ("qk_rope_dim", MAX_MODEL_DIMENSION),
    "experts": ("num_experts", MAX_EXPERTS),
    "topK": ("top_k", MAX_EXPERTS),
    "expertFfn": ("expert_ffn", MAX_MODEL_DIMENSION),
    "sharedExperts": ("num_shared_experts", MAX_EXPERTS),
    "sharedExpertFfn": ("shared_expert_ffn", MAX_MODEL_DIMENSION),
    "denseFfn": ("dense_ffn", MAX_MODEL_DIMENSION),
    "expertGroups": ("n_group", MAX_EXPERTS),
    "topkGroups": ("topk_group", MAX_EXPERTS),
    "mtpLayers": ("mtp_layers", 16),
    "attentionWindow": ("attention_window", MAX_MODEL_DIMENSION),
    "firstDenseLayers": ("", MAX_LAYERS),
}
_SPEC_OTHER = (
    "attention",
    "weightDtype",
    "expertDtype",
    "tieEmbeddings",
    "sharedExpertGate",
    "moeLayers",
    "windowedLayers",
    "family",
)
_DTYPES = ("bf16", "fp16", "fp8", "mxfp4")


def _layers(spec: Mapping[str, Any], key: str, n_layers: int) -> tuple[int, ...]:
    raw = spec.get(key, [])
    if not isinstance(raw, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in raw
    ):
        raise InputError(
            f"must be a list of layer indices from 0 to {n_layers - 1}, got {raw!r:.80}",
            field=f"spec.{key}",
        )
    return tuple(sorted(set(raw)))


def _choice(spec: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = spec.get(key, default)
    if value not in allowed:
        raise InputError(
            f"must be one of {', '.join(allowed)}, got {value!r:.40}", field=f"spec.{key}"
        )
    return str(value)


def _spec_ints(spec: Mapping[str, Any]) -> dict[str, int]:
    """The integer fields given, by ModelSpec name (``firstDenseLayers`` under its own)."""
    out: dict[str, int] = {}
    for key, (attr, maximum) in _SPEC_INTS.items():
        if key in spec:
            out[attr or key] = bounded_int(spec[key], f"spec.{key}", minimum=0, maximum=maximum)
    for key in ("numLayers", "hiddenSize", "vocabSize", "queryHeads"):
        if not out.get(_SPEC_INTS[key][0]):
            raise InputError(f"must be given, > 0 (a {key} of the model)", field=f"spec.{key}")
    return out


def model_file_fields(doc: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """The :class:`policies.model.architecture.ModelSpec` keyword arguments of a Model document.

    Raises:
        InputError: an unknown key (with its path and the closest known key), a missing
            or out-of-range field.
    """
    check_keys(doc, _TOP, "")
    meta = doc.get("metadata") or {}
    spec = doc.get("spec")
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise InputError("metadata and spec must be mappings", field="spec")
    check_keys(meta, ("name",), "metadata")
    check_keys(spec, (*_SPEC_INTS, *_SPEC_OTHER), "spec")
    ints = _spec_ints(spec)
    n = ints["num_layers"]
    attention = _choice(spec, "attention", ("gqa", "mla"), "gqa")
    head_dim = ints.get("head_dim") or ints["hidden"] // ints["num_q_heads"]
    experts = ints.get("num_experts", 0)
    first_dense = ints.pop("firstDenseLayers", 0)
    moe = _layers(spec, "moeLayers", n) if "moeLayers" in spec else tuple(range(first_dense, n))
    weight_dtype = _choice(spec, "weightDtype", _DTYPES, "bf16")
    fields: dict[str, Any] = {
        "name": str(meta.get("name") or name or "model"),
        "family": str(spec.get("family", "custom")),
        "num_kv_heads": ints["num_q_heads"] if attention == "gqa" else 1,
        "v_head_dim": head_dim,
        "q_lora_rank": 0,
        "kv_lora_rank": 0,
        "qk_rope_dim": 0,
        "num_experts": 0,
        "num_shared_experts": 0,
        "top_k": 0,
        "expert_ffn": 0,
        "dense_ffn": 0,
        "n_group": 1,
        "topk_group": 1,
        **ints,
        "head_dim": head_dim,
        "attention": attention,
        "moe_layers": moe if experts else (),
        "weight_dtype": weight_dtype,
        "expert_dtype": _choice(spec, "expertDtype", _DTYPES, weight_dtype),
        "tie_embeddings": bool(spec.get("tieEmbeddings", False)),
        "shared_expert_gate": bool(spec.get("sharedExpertGate", False)),
        "windowed_layers": _layers(spec, "windowedLayers", n),
    }
    if len(fields["moe_layers"]) < n and not fields["dense_ffn"]:
        raise InputError("must be given: the model has dense layers", field="spec.denseFfn")
    if fields["windowed_layers"] and not fields.get("attention_window"):
        raise InputError("must be given with windowedLayers", field="spec.attentionWindow")
    fields["n_group"] = fields["n_group"] or 1
    fields["topk_group"] = fields["topk_group"] or 1
    return fields
