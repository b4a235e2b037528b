"""``mixfleet-router``: the request path that imposes a committed plan on the engines.

Every engine balances its data-parallel (DP) attention ranks equally; a plan's per-rank
``dp_weights``, its tiers and its replica groups only take effect when something in front of
the engines picks the rank of each request and pins it with the engine's own per-request
field (SGLang ``routed_dp_rank``, vLLM ``X-data-parallel-rank``; trtllm-serve has none,
see :mod:`.requests`). This package is that router: an aiohttp server (:mod:`.proxy`)
whose engine side is its own relay (:mod:`.relay`: pooled HTTP/1.1 connections, bodies
forwarded from the engine connection's reads), over a pure balancer (:mod:`.balance`), fed
live weights from the controller's ``EngineService.WatchRouting`` (:mod:`.routing`), health
checks on their own thread (:mod:`.health`), Prometheus metrics (:mod:`.metrics`); settings,
limits and flags in :mod:`.settings`, per-request parsing (depth check, tier, work estimate,
rank field) in :mod:`.requests`, the client side before routing (error answers, body
bounds) in :mod:`.intake`, the listening socket (request-head deadline, collector settings)
in :mod:`.listener`, one or several worker processes in :mod:`.workers`.
"""
