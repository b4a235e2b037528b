"""A deployment's engine instances as the controller lists them (``EngineService.
WatchInstances``), turned into the router's instances. Pure: no I/O, no clock.

* An ``aggregated`` instance is one routed instance at its ``url``, named as the
  controller names it; its DP ranks and weights come from ``WatchRouting(<its name>)``.
* The ``prefill`` and ``decode`` instances of one ``pool`` are ONE prefill/decode pair
  (:mod:`.pd`), named ``<deployment>/<pool>``: its prefill URLs and their bootstrap ports
  from the prefill instances, its decode URLs from the decode instances (each in name
  order), its protocol ``Instances.engine`` (``sglang`` | ``vllm``), its ranks and weights
  those of its first decode instance (one pool's decode instances are one planned make-up).
  A TensorRT-LLM pool is served by TensorRT-LLM's own disaggregated server: it is skipped
  (with a note for the log), as is a pool of another engine or one without a prefill or a
  decode instance that has a URL (an instance not placed yet has none).
* Share of the tier: an instance's ``requests_per_s`` (a pair's: the sum over its decode
  instances that take traffic); when every instance of the deployment has 0, each gets
  its number of DP ranks (:attr:`InstanceSpec.share` None).
* Batch cap: an instance's ``batch_limit`` (a pair's: the sum over its decode instances
  that take traffic, 0 when one of them has none: no cap).
* Routable: ``ready`` and not ``draining`` (a pair: at least one prefill and one decode
  instance that are). An instance that is not routable, or that the next message no longer
  lists, gets no new requests; its open ones finish (:meth:`.state.RouterState.sync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mixfleet.v1 import engine_pb2

from controlplane.router.settings import (
    DEFAULT_BOOTSTRAP_PORT,
    ENGINES,
    PD_PROTOCOLS,
    InstanceSpec,
    Watched,
    is_http_url,
)


@dataclass(frozen=True)
class Listed:
    """One router instance the controller lists.

    Attributes:
        spec: how to reach and weigh it.
        routable: it may take new requests.
    """

    spec: InstanceSpec
    routable: bool


@dataclass(frozen=True)
class InstanceSet:
    """What one ``Instances`` message means to the router.

    Attributes:
        deployment: the watched deployment. generation: the message's generation.
        listed: the router instances, in the message's order.
        skipped: why an instance or pool was left out, one line each (for the log).
    """

    deployment: str
    generation: int
    listed: tuple[Listed, ...]
    skipped: tuple[str, ...]


def _takes_traffic(i: engine_pb2.Instance) -> bool:
    return i.ready and not i.draining


def instance_set(message: engine_pb2.Instances, watched: Watched) -> InstanceSet:
    """The router instances of ``message`` (rules in the module docstring)."""
    engine = message.engine if message.engine in ENGINES else ""
    listed: list[Listed] = []
    skipped: list[str] = []
    pools: dict[str, list[engine_pb2.Instance]] = {}
    for i in message.instances:
        if i.role in ("prefill", "decode"):
            pools.setdefault(i.pool, []).append(i)
        elif i.role != "aggregated":
            skipped.append(f"instance {i.name!r}: role {i.role!r} is unknown")
        elif not is_http_url(i.url):
            skipped.append(f"instance {i.name!r}: url {i.url!r} is not http(s)://HOST:PORT")
        else:
            spec = InstanceSpec(
                name=i.name,
                url=i.url.rstrip("/"),
                tier=watched.tier,
                deployment=i.name,
                engine=engine,
                share=i.requests_per_s,
                source=watched.name,
                batch_limit=max(i.batch_limit, 0),
            )
            listed.append(Listed(spec, _takes_traffic(i)))
    for pool, members in pools.items():
        got = _pair(message.engine, pool, members, watched)
        if isinstance(got, str):
            skipped.append(got)
        else:
            listed.append(got)
    if not any((item.spec.share or 0) > 0 for item in listed):
        listed = [Listed(_share(item.spec, None), item.routable) for item in listed]
    else:
        listed = [
            Listed(_share(item.spec, max(item.spec.share or 0.0, 0.0)), item.routable)
            for item in listed
        ]
    return InstanceSet(watched.name, message.generation, tuple(listed), tuple(skipped))


def _share(spec: InstanceSpec, share: float | None) -> InstanceSpec:
    return replace(spec, share=share)


def _pair(
    engine: str, pool: str, members: Sequence[engine_pb2.Instance], watched: Watched
) -> Listed | str:
    """The pair of one prefill/decode pool, or why it is skipped."""
    where = f"pool {pool!r} of {watched.name!r}"
    if engine == "trtllm":
        return f"{where}: a TensorRT-LLM pool is served by its own disaggregated server"
    if engine not in PD_PROTOCOLS:
        return f"{where}: engine {engine!r} has no prefill/decode protocol here (sglang, vllm)"
    members = [m for m in members if is_http_url(m.url)]  # one not placed yet has no url
    sides = {
        role: sorted((m for m in members if m.role == role), key=lambda m: m.name)
        for role in ("prefill", "decode")
    }
    live = {role: [m for m in ms if _takes_traffic(m)] for role, ms in sides.items()}
    if not sides["prefill"] or not sides["decode"]:
        side = "prefill" if not sides["prefill"] else "decode"
        return f"{where}: it lists no {side} instance with an http(s)://HOST:PORT url"
    routable = bool(live["prefill"]) and bool(live["decode"])
    prefill = live["prefill"] or sides["prefill"]
    decode = live["decode"] or sides["decode"]
    limits = [m.batch_limit for m in decode]
    spec = InstanceSpec(
        name=f"{watched.name}/{pool}",
        url=decode[0].url.rstrip("/"),
        tier=watched.tier,
        deployment=decode[0].name,
        engine=engine,
        share=sum(m.requests_per_s for m in live["decode"]),
        pd=engine,
        prefill=tuple(m.url.rstrip("/") for m in prefill),
        decode=tuple(m.url.rstrip("/") for m in decode),
        bootstrap_port=prefill[0].bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
        bootstrap_ports=tuple(m.bootstrap_port or DEFAULT_BOOTSTRAP_PORT for m in prefill),
        source=watched.name,
        batch_limit=sum(limits) if all(v > 0 for v in limits) else 0,
    )
    return Listed(spec, routable)
