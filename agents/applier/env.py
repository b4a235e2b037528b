"""The env file of one GPU's engine container (``gpu<i>.env``, ``docker run --env-file``):
what it holds (:func:`gpu_env`, with :func:`instance_env`, which the hook gets too), how it
is written (:func:`render_env`, values quoted for a POSIX shell) and read back
(:func:`parse_env`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from agents.applier.assignment import NodeAssignment, gpu_index
from policies.errors import InputError


def instance_env(a: NodeAssignment) -> dict[str, str]:
    """The engine instance ``a``'s deployment is, as environment variables; always all four,
    ``""`` / ``"0"`` for a deployment not cut into instances (0: the engine's default port).

    ``MIXFLEET_ROLE`` (``aggregated`` | ``prefill`` | ``decode``), ``MIXFLEET_INSTANCE_OF``
    (the deployment served), ``MIXFLEET_ENGINE_PORT`` (HTTP port routers reach the engine
    at on the instance's first node), ``MIXFLEET_BOOTSTRAP_PORT`` (a prefill instance's
    SGLang bootstrap port).
    """
    return {
        "MIXFLEET_ROLE": a.role,
        "MIXFLEET_INSTANCE_OF": a.instance_of,
        "MIXFLEET_ENGINE_PORT": str(a.engine_port),
        "MIXFLEET_BOOTSTRAP_PORT": str(a.bootstrap_port),
    }


def gpu_env(
    a: NodeAssignment, k: int, experts_file: Path, location_file: Path | None
) -> dict[str, str]:
    """Environment of the engine container of ``a.gpus[k]``; file paths point through the
    deployment's link so they stay valid across versions."""
    g = a.gpus[k]
    h = g.hints
    env = {
        "MIXFLEET_DEPLOYMENT": a.deployment,
        "MIXFLEET_PLAN_ID": a.plan_id,
        "MIXFLEET_PLAN_VERSION": str(a.version),
        "MIXFLEET_NODE": a.node,
        "MIXFLEET_MODEL": a.model,
        "MIXFLEET_FORM": a.form,
        "MIXFLEET_GPU_ID": g.gpu,
        "MIXFLEET_GPU_INDEX": str(gpu_index(g)),
        "MIXFLEET_RANK": str(a.ranks[k]),
        "MIXFLEET_WORLD_SIZE": str(a.world_size),
        "MIXFLEET_ATTENTION_SHARE": f"{g.attention_share:.9f}",
        "MIXFLEET_DP_WEIGHT": f"{g.dp_weight:.9f}",
        "MIXFLEET_EXPERTS_FILE": str(experts_file),
        "MIXFLEET_EP_BACKEND": h.ep_backend,
        "MIXFLEET_DEEPEP_MODE": h.deepep_mode,
        "MIXFLEET_DEEPEP_NUM_SMS": str(h.deepep_num_sms),
        "MIXFLEET_DEEPEP_NUM_NVL_BYTES": str(h.num_nvl_bytes),
        "MIXFLEET_DEEPEP_NUM_RDMA_BYTES": str(h.num_rdma_bytes),
        "MIXFLEET_FP8_DISPATCH": "1" if h.fp8_dispatch else "0",
        "MIXFLEET_ATTENTION_BACKEND": h.attention_backend,
        "MIXFLEET_DECODE_NUM_SPLITS": str(h.decode_num_splits),
        **instance_env(a),
    }
    if a.slots_per_gpu is not None:
        env["MIXFLEET_SLOTS_PER_GPU"] = str(a.slots_per_gpu)
    if g.attention_heads is not None:
        env["MIXFLEET_ATTENTION_HEADS"] = str(g.attention_heads)
    if location_file is not None:
        env["MIXFLEET_EXPERT_LOCATION_FILE"] = str(location_file)
    return env


def render_env(env: Mapping[str, str]) -> str:
    """``KEY=VALUE`` lines as ``docker run --env-file`` reads them (no quoting)."""
    for k, v in env.items():
        if "\n" in v or "\n" in k:
            raise InputError("env values cannot contain newlines", field=k)
    return "".join(f"{k}={v}\n" for k, v in sorted(env.items()))


def parse_env(text: str) -> dict[str, str]:
    """Inverse of :func:`render_env`."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out
