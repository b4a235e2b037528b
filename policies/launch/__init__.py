"""Launch recipes: the command line and environment that start a plan's engine, node by node.

A plan is only worth what its engine executes, so the engine must be started with the
expert-parallel shape, all-to-all backend, replica rule and placement file the plan was
predicted under. :func:`launch_recipe` turns an engine plan into one :class:`NodeLaunch`
per node, in the plan's rank order (``plan.gpus``; a node's ranks must be contiguous), with
the flags of the engine versions mixfleet models (:data:`policies.estimate.engines.PINNED_VERSIONS`,
read from each engine's own argument definitions):

* SGLang 0.5.23 - ``python3 -m sglang.launch_server --tp-size N --attn-dp-size N/t
  --ep-size N --moe-a2a-backend B --ep-num-redundant-experts R --init-expert-location FILE
  [--ep-dispatch-algorithm D] --nnodes K --node-rank i [--dist-init-addr ADDR]``
  (``--attn-dp-size`` replaces the deprecated ``--dp-size N --enable-dp-attention``;
  ``--enable-eplb`` is never passed: its rebalancing would overwrite the placement).
* vLLM 0.33.0 - ``vllm serve --tensor-parallel-size t --data-parallel-size N/t
  --enable-expert-parallel --all2all-backend B``, per node ``--data-parallel-size-local``,
  ``--data-parallel-start-rank``, ``--data-parallel-address``/``--data-parallel-rpc-port``
  (``--headless`` past node 0); ``--enable-eplb --eplb-config`` whenever vLLM needs its
  ``EplbState`` (:func:`~policies.exports.engine.vllm_needs_eplb`: redundant slots, or any placement
  but vLLM's default layout - also with R = 0), whose ``step_interval``
  (:data:`~policies.exports.engine.VLLM_NO_REBALANCE_STEP_INTERVAL`) keeps EPLB's own rebalancing
  from firing.
  vLLM has no flag that loads a placement (docs/engines.md); the recipe's notes say so.
* TensorRT-LLM - ``trtllm-serve --tp_size N --ep_size N --extra_llm_api_options FILE`` with
  ``enable_attention_dp: true`` and ``moe_config.load_balancer`` = the exported file in that
  options YAML (:attr:`LaunchRecipe.files`), the plan's backend forced by
  ``TRTLLM_FORCE_ALLTOALL_METHOD`` (``DeepEP`` or ``NotEnabled``: all-gather and
  reduce-scatter); several nodes run as one MPI job (``trtllm-llmapi-launch`` on every rank).

**Roles** (:data:`policies.fleetplan.ROLES`). An ``aggregated`` server runs both phases. A ``prefill`` or
``decode`` server of a prefill/decode pool (:class:`KvTransfer`: the KV path between the
pools and the engine's transfer backend, :data:`TRANSFER_BACKENDS`) adds:

* SGLang - ``--disaggregation-mode prefill|decode --disaggregation-transfer-backend B``
  (``mooncake`` over RDMA, ``nixl`` over RDMA or NVLink), ``--disaggregation-bootstrap-port
  P`` on prefill (its bootstrap server; the router sends ``bootstrap_host``/``port``/``room``
  on both requests);
* vLLM - ``--kv-transfer-config {"kv_connector": C, "kv_role": R}`` with ``kv_producer`` on
  prefill and ``kv_consumer`` on decode (vLLM 0.33.0's ``NixlConnector`` deprecates
  ``kv_both``), and for NIXL ``VLLM_NIXL_SIDE_CHANNEL_HOST`` = the node's own address;
* TensorRT-LLM - ``cache_transceiver_config: {backend: B}`` in the server's options YAML
  (``disable_overlap_scheduler: true`` on context servers), ``--host``/``--port`` so the
  disaggregated server reaches it, and per pool the YAML ``trtllm-serve disaggregated -c``
  reads (:func:`trtllm_disagg_config`: ``context_servers`` / ``generation_servers`` with
  ``urls``).

A pool without an RDMA or NVLink path, or a backend that does not run over the pool's path,
is refused (:func:`transfer_backend`). :func:`planned_instances` reads a deployment's engine
instances from a ``FleetPlan`` document (``mixfleetctl schedule show -o json``) and
:func:`deployment_launch` builds every instance's recipe from its placement plan.

``CUDA_VISIBLE_DEVICES`` lists each node's GPU indices (from the plan's ``node/gpuN`` ids, NVML
order, hence ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) in rank order. Values not known when the
recipe is built are shell references the caller's environment fills: ``${MIXFLEET_MODEL_PATH}``,
``${MIXFLEET_DIST_INIT_ADDR}`` (``HOST:PORT`` of node 0) and, for prefill/decode servers,
``${MIXFLEET_NODE_ADDR}`` (the address other nodes reach this node at).
The package, a module per concern: :mod:`~policies.launch.types` (the values and defaults),
:mod:`~policies.launch.recipe` (checks, shape, :func:`launch_recipe`),
:mod:`~policies.launch.engines` (each engine's flags and notes), :mod:`~policies.launch.fleet`
(fleet plans: instances, :func:`deployment_launch`) and :mod:`~policies.launch.render` (``sh``
and JSON). Every public name is importable from ``policies.launch``.

Pure: builds values and text, does no I/O.
"""

from __future__ import annotations

from policies.defaults import PLACEMENT_FILES, TRTLLM_OPTIONS_FILE  # one default: defaults
from policies.exports.engine import vllm_default_rows  # one owner: exports
from policies.launch.fleet import (
    DeploymentLaunch,
    InstanceLaunch,
    PlannedInstance,
    deployment_launch,
    deployment_launch_to_doc,
    instance_path,
    instance_request,
    instance_spec,
    planned_instances,
    trtllm_disagg_config,
)
from policies.launch.recipe import launch_recipe, path_kind, transfer_backend
from policies.launch.render import (
    failing_script,
    launch_script,
    node_command,
    recipe_to_doc,
    shell_word,
)
from policies.launch.types import (
    DIST_INIT_REF,
    MODEL_PATH_REF,
    NODE_ADDR_REF,
    SGLANG_BOOTSTRAP_PORT,
    TRANSFER_BACKENDS,
    TRTLLM_SERVER_PORT,
    KvTransfer,
    LaunchRecipe,
    NodeLaunch,
)

__all__ = [
    "DIST_INIT_REF",
    "MODEL_PATH_REF",
    "NODE_ADDR_REF",
    "PLACEMENT_FILES",
    "SGLANG_BOOTSTRAP_PORT",
    "TRANSFER_BACKENDS",
    "TRTLLM_OPTIONS_FILE",
    "TRTLLM_SERVER_PORT",
    "DeploymentLaunch",
    "InstanceLaunch",
    "KvTransfer",
    "LaunchRecipe",
    "NodeLaunch",
    "PlannedInstance",
    "deployment_launch",
    "deployment_launch_to_doc",
    "failing_script",
    "instance_path",
    "instance_request",
    "instance_spec",
    "launch_recipe",
    "launch_script",
    "node_command",
    "path_kind",
    "planned_instances",
    "recipe_to_doc",
    "shell_word",
    "transfer_backend",
    "trtllm_disagg_config",
    "vllm_default_rows",
]
