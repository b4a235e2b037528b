"""The values a launch recipe is made of: what each node runs, the prefill/decode KV link,
the recipe itself, and the defaults that stand in for what is not known when it is built.

Pure: data only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.defaults import SGLANG_BOOTSTRAP_PORT as SGLANG_BOOTSTRAP_PORT
from policies.defaults import SGLANG_SERVER_PORT as SGLANG_SERVER_PORT

MODEL_PATH_REF = "${MIXFLEET_MODEL_PATH}"
"""The model path when none is given: the weights directory or Hugging Face id, from the
environment."""
DIST_INIT_REF = "${MIXFLEET_DIST_INIT_ADDR}"
"""Node 0's ``HOST:PORT`` when none is given (multi-node only), from the environment."""
NODE_ADDR_REF = "${MIXFLEET_NODE_ADDR}"
"""The address other nodes reach this node at (prefill/decode servers), from the environment."""

TRTLLM_SERVER_PORT = 8000
"""``trtllm-serve``'s default ``--port``: where a context or generation server listens, and
the port of its URL in the disaggregated server's YAML, TCP port."""

TRANSFER_BACKENDS: Mapping[str, Mapping[str, frozenset[str]]] = {
    "sglang": {
        "mooncake": frozenset({"rdma"}),
        "nixl": frozenset({"rdma", "nvlink"}),
    },
    "vllm": {
        "NixlConnector": frozenset({"rdma", "nvlink"}),
        "MooncakeConnector": frozenset({"rdma"}),
    },
    "trtllm": {
        "UCX": frozenset({"rdma", "nvlink"}),
        "NIXL": frozenset({"rdma", "nvlink"}),
        "MOONCAKE": frozenset({"rdma"}),
    },
}
"""Per engine, the KV transfer backends a recipe names (SGLang
``--disaggregation-transfer-backend``, vLLM's ``kv_connector``, TensorRT-LLM's
``cache_transceiver_config.backend``) and the paths (``rdma``, ``nvlink``) each runs over;
the first that runs over a pool's path is the default. Mooncake moves KV with RDMA
(``mooncake_tcp`` and Mooncake's NVLink transport are left out: the planner's pools are
priced on RDMA or NVLink bandwidth)."""


@dataclass(frozen=True)
class NodeLaunch:
    """What one node runs.

    Attributes:
        node: node name.
        node_rank: the node's position in rank order (0 = first node).
        rank_range: ``(first, end)`` global ranks on this node, end exclusive.
        argv: the command line (tokens may contain the ``${...}`` references above).
        env: environment variables to set.
    """

    node: str
    node_rank: int
    rank_range: tuple[int, int]
    argv: tuple[str, ...]
    env: Mapping[str, str]


@dataclass(frozen=True)
class KvTransfer:
    """How the prefill and decode instances of a pool move KV.

    Attributes:
        path: the KV path in the fleet planner's words (``RDMA ib0``, ``RDMA ib0-ib1``,
            ``NVLink nvl72-0``; :func:`policies.fleetplan.kv_path`), or just ``rdma`` or
            ``nvlink``; its first word is the kind. Empty: no path (refused).
        backend: the engine's transfer backend (:data:`TRANSFER_BACKENDS`); "" = the
            engine's first that runs over the path.
        bootstrap_port: SGLang: the TCP port of the prefill server's bootstrap server.
    """

    path: str
    backend: str = ""
    bootstrap_port: int = SGLANG_BOOTSTRAP_PORT


@dataclass(frozen=True)
class LaunchRecipe:
    """How to start the engine of a plan.

    Attributes:
        plan_id: the plan.
        engine: ``sglang 0.5.23`` (engine and version whose flags these are).
        nodes: per node, rank order.
        files: documents the commands read besides the placement file, by path (the
            TensorRT-LLM options YAML).
        notes: what the caller must know (what the engine cannot load, DP routing).
        role: ``aggregated``, ``prefill`` or ``decode`` (:data:`policies.fleetplan.ROLES`).
        transfer_backend: prefill/decode: the engine's KV transfer backend ("" aggregated).
        bootstrap_port: SGLang prefill: its bootstrap server's TCP port (None otherwise).
        placement_path: the placement file the commands read, as the engine sees it.
    """

    plan_id: str
    engine: str
    nodes: tuple[NodeLaunch, ...]
    files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    role: str = "aggregated"
    transfer_backend: str = ""
    bootstrap_port: int | None = None
    placement_path: str = ""


@dataclass(frozen=True)
class Shape:
    """The parallel shape of a plan: ``n`` ranks, attention TP ``tp``, nodes in rank order
    with their ranks and GPU indices."""

    n: int
    tp: int
    nodes: tuple[tuple[str, int, int, tuple[int, ...]], ...]  # node, first, end, indices


PdServer = tuple[str, str, KvTransfer] | None
"""A prefill/decode server's role, transfer backend and pool link; None for aggregated."""
