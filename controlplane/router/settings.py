"""Settings of ``mixfleet-router`` and the parsing of its flags (one ``error:`` line
naming the flag on bad input).

An engine instance is one HTTP entrypoint of one engine server (its DP attention ranks
behind it), given as ``--instance url=URL[,name=N][,deployment=D][,tier=T][,engine=E]
[,ranks=R][,share=S]``:

* ``deployment``: take the instance's ranks and weights from that deployment's committed
  routing (``EngineService.WatchRouting``); without it the instance has ``ranks`` equal ranks
  (an interactive replica: one NVLink domain of identical GPUs needs no unequal shares), or
  the fixed per-rank ``weights`` (``weights=1.2:0.8:...``, one per DP rank).
* ``tier``: the tier it serves (default ``--default-tier``); instances of one tier form its
  replica group.
* ``engine``: ``sglang`` | ``vllm`` | ``trtllm`` | ``native``: which rank field to set;
  default the engine the routing names, else ``sglang``.
* ``share``: the instance's share of its tier (default: its number of DP ranks).

A prefill/decode pair is one instance too: ``--instance pd=sglang|vllm,prefill=URL[+URL...],
decode=URL[+URL...][,bootstrap_port=P][,name=...]`` (no ``url=``; its health is checked on
its first decode URL). ``pd`` names the protocol the router drives the pair with
(:mod:`.pd`); ``bootstrap_port`` is SGLang's ``--disaggregation-bootstrap-port`` of the
prefill servers (default 8998).

``--deployment NAME[,tier=T]`` takes a deployment's instances from the controller instead
(``EngineService.WatchInstances``, :mod:`.instances`); both kinds may be combined.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

from policies.defaults import SGLANG_BOOTSTRAP_PORT
from policies.errors import InputError

ENGINES = ("sglang", "vllm", "trtllm", "native")
#: Default cap on a request's output tokens (``--max-output-tokens``): 128 Ki, the context
#: of the largest models served (a limit above it cannot be generated anyway).
MAX_OUTPUT_TOKENS = 131_072
_KEYS = (
    "url",
    "name",
    "deployment",
    "tier",
    "engine",
    "ranks",
    "share",
    "weights",
    "pd",
    "prefill",
    "decode",
    "bootstrap_port",
)
#: Protocols of a prefill/decode pair (``pd=``).
PD_PROTOCOLS = ("sglang", "vllm")
#: SGLang's default ``--disaggregation-bootstrap-port``.
DEFAULT_BOOTSTRAP_PORT = SGLANG_BOOTSTRAP_PORT


@dataclass(frozen=True)
class InstanceSpec:
    """One engine instance behind the router.

    Attributes:
        name: unique name (labels in metrics and logs).
        url: base URL, ``http://HOST:PORT`` (or https).
        tier: the tier it serves.
        deployment: deployment whose committed routing sets its ranks; "" = static ranks.
        engine: rank field to set ("" = the routing's engine, else ``sglang``).
        ranks: static DP ranks (no deployment), >= 1.
        share: its share of its tier's traffic (any positive scale); None = its rank count.
        weights: fixed per-rank weights of a static instance (empty = ``ranks`` equal).
        pd: protocol of a prefill/decode pair (``sglang`` | ``vllm``); "" = one server.
        prefill, decode: base URLs of a pair's prefill and decode servers (empty = none).
        bootstrap_port: SGLang prefill servers' bootstrap port (a pair of protocol sglang).
        bootstrap_ports: the bootstrap port of each prefill URL (empty: ``bootstrap_port``
            for all).
        source: the ``--deployment`` whose controller-listed instances it is one of ("" = an
            ``--instance`` flag).
        batch_limit: most requests open on it at once, requests (0 = no cap; the plan's SLO
            batch of a controller-listed instance).
    """

    name: str
    url: str
    tier: str
    deployment: str = ""
    engine: str = ""
    ranks: int = 1
    share: float | None = None
    weights: tuple[float, ...] = ()
    pd: str = ""
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    bootstrap_ports: tuple[int, ...] = ()
    source: str = ""
    batch_limit: int = 0


def host_name() -> str:
    """This machine's host name (the default ``--reporter``), else ``mixfleet-router``."""
    return socket.gethostname() or "mixfleet-router"


@dataclass(frozen=True)
class Watched:
    """A deployment whose instances come from the controller (``--deployment``).

    Attributes:
        name: the deployment. tier: the tier its instances serve.
    """

    name: str
    tier: str


@dataclass(frozen=True)
class TlsClient:
    """Mutual TLS to the controller: paths of PEM files.

    Attributes:
        ca: the controller's CA. cert, key: the router's client certificate and key ("" =
            server authentication only).
    """

    ca: str
    cert: str = ""
    key: str = ""


@dataclass(frozen=True)
class RouterSettings:
    """Everything ``mixfleet-router`` runs with.

    Attributes:
        instances: engine instances given by ``--instance``.
        watched: deployments whose instances come from the controller (``--deployment``).
        listen_host, listen_port: where the router listens (port 0 = any free port).
        controller: controller ``HOST:PORT``; "" = no controller (static ranks only).
        token: bearer token for the controller ("" = none).
        tls: mutual TLS to the controller; None = plaintext.
        default_tier: tier of a request that names none.
        api_key_tiers: API key -> tier.
        priority_tiers: ``X-Priority-Class`` value -> tier.
        queue_limit: most requests open per DP rank; above it on every rank: 429.
        retry_after_s: the ``Retry-After`` of a 429, seconds.
        max_attempts: tries of a request (on different instances) while nothing was
            streamed back.
        default_output_tokens: expected output of a request that sets no limit, tokens.
        tokenizer: Hugging Face tokenizer name or path ("" = characters / 4 estimate).
        health_interval_s: period of the health checks, seconds.
        health_timeout_s: timeout of one check, seconds.
        eject_after: consecutive failed checks that eject an instance.
        readmit_after: consecutive passed checks that re-admit it.
        connect_timeout_s: connect timeout to an engine, seconds.
        read_timeout_s: longest silence from an engine inside a response, seconds.
        backoff_initial_s, backoff_max_s: reconnect backoff to the controller, seconds.
        max_body_bytes: largest request body accepted, bytes (above it: 413).
        max_inflight_body_bytes: most bytes of request bodies held at once, all requests
            together, bytes (a body that would pass it: 429).
        max_output_tokens: largest output limit a request may set (``max_tokens`` ...),
            tokens (above it: 400).
        max_json_depth: deepest nesting of a request's JSON (arrays and objects), levels;
            checked before parsing (above it: 400).
        header_timeout_s: longest time from a request's first byte to the end of its
            headers, seconds (then the connection is closed).
        body_timeout_s: longest time to receive a request's body once its headers are
            in, seconds (then 408 and the connection is closed).
        idle_timeout_s: longest time a client connection may sit with no request,
            seconds (keep-alive; also bounds a connection that sends nothing at all).
        tier_headers: honour ``X-Mixfleet-Tier`` and ``X-Priority-Class``; None = only
            when no API key defines tiers (see :attr:`honour_tier_headers`).
        batch_queue: most requests of one tier waiting for a slot while every instance is
            at its batch limit, requests (one more: 429 at once).
        batch_wait_s: longest wait of a request for a slot, seconds (then 429).
        traffic_report_s: length of a measured traffic window (one ``ReportTraffic`` per
            watched deployment each), seconds.
        reporter: the router's name in its traffic reports.
    """

    instances: tuple[InstanceSpec, ...]
    watched: tuple[Watched, ...] = ()
    listen_host: str = "0.0.0.0"
    listen_port: int = 8000
    controller: str = ""
    token: str = ""
    tls: TlsClient | None = None
    default_tier: str = "default"
    api_key_tiers: Mapping[str, str] = field(default_factory=dict)
    priority_tiers: Mapping[str, str] = field(default_factory=dict)
    queue_limit: int = 256
    retry_after_s: int = 1
    max_attempts: int = 2
    default_output_tokens: int = 256
    tokenizer: str = ""
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    eject_after: int = 2
    readmit_after: int = 2
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    max_body_bytes: int = 32 << 20
    max_inflight_body_bytes: int = 128 << 20
    max_output_tokens: int = MAX_OUTPUT_TOKENS
    max_json_depth: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    tier_headers: bool | None = None
    batch_queue: int = 256
    batch_wait_s: float = 10.0
    traffic_report_s: float = 10.0
    reporter: str = field(default_factory=host_name)

    @property
    def honour_tier_headers(self) -> bool:
        """Whether a client may name its tier by header: as set, else only when there is
        no ``--api-key-tiers`` (where API keys define tiers, a header would bypass them)."""
        return not self.api_key_tiers if self.tier_headers is None else self.tier_headers

    @property
    def tiers(self) -> frozenset[str]:
        return frozenset(i.tier for i in self.instances) | {w.tier for w in self.watched}

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i.deployment for i in self.instances if i.deployment))


def parse_instance(text: str, default_tier: str) -> InstanceSpec:
    """One ``--instance`` value (module docstring).

    Raises:
        InputError: naming ``--instance`` and the bad key.
    """
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise InputError(
                f"{part!r} is not KEY=VALUE with KEY one of {', '.join(_KEYS)}. To fix: e.g. "
                "--instance url=http://10.0.0.1:30000,deployment=ds3,tier=batch",
                field="--instance",
            )
        fields[key] = value.strip()
    pair = _pair(fields)
    url = pair[1][0] if pair[0] else fields.get("url", "")
    parts = _http_url(url, "url")
    engine = fields.get("engine", "")
    if engine and engine not in ENGINES:
        raise InputError(
            f"engine {engine!r} is unknown; use one of {', '.join(ENGINES)}", field="--instance"
        )
    ranks = _positive_int(fields.get("ranks", "1"), "ranks")
    share = fields.get("share")
    share_v = None
    if share is not None:
        try:
            share_v = float(share)
        except ValueError:
            share_v = -1.0
        if not (share_v > 0 and math.isfinite(share_v)):
            raise InputError(f"share {share!r} must be a number > 0", field="--instance")
    weights = _weights(fields.get("weights", ""))
    if weights and fields.get("deployment"):
        raise InputError(
            "weights= and deployment= exclude each other (the deployment's plan sets the weights)",
            field="--instance",
        )
    return InstanceSpec(
        name=fields.get("name") or f"{parts.hostname}:{parts.port or 80}",
        url=url.rstrip("/"),
        tier=fields.get("tier") or default_tier,
        deployment=fields.get("deployment", ""),
        engine=engine or pair[0],
        ranks=len(weights) or ranks,
        share=share_v,
        weights=weights,
        pd=pair[0],
        prefill=pair[2],
        decode=pair[1],
        bootstrap_port=_port(fields.get("bootstrap_port", str(DEFAULT_BOOTSTRAP_PORT))),
    )


def parse_deployment(text: str, default_tier: str) -> Watched:
    """One ``--deployment NAME[,tier=T]`` value.

    Raises:
        InputError: naming ``--deployment``: no name, or a key other than ``tier``.
    """
    name, *rest = (p.strip() for p in text.split(","))
    tier = default_tier
    for part in rest:
        key, sep, value = part.partition("=")
        if key.strip() != "tier" or not sep or not value.strip():
            raise InputError(
                f"{part!r} is not tier=TIER. To fix: e.g. --deployment ds3,tier=batch",
                field="--deployment",
            )
        tier = value.strip()
    if not name or "=" in name:
        raise InputError(
            f"{text!r} does not start with the deployment's name. To fix: e.g. "
            "--deployment ds3,tier=batch",
            field="--deployment",
        )
    return Watched(name, tier)


def is_http_url(url: str) -> bool:
    """Whether ``url`` is ``http(s)://HOST[:PORT]`` with a port in 1..65535 when given."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # an unclosed IPv6 bracket, a port that is not a number
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port_ok


def _http_url(url: str, key: str) -> SplitResult:
    if not is_http_url(url):
        raise InputError(
            f"{key} {url!r} is not http(s)://HOST:PORT. To fix: give {key}=http://HOST:PORT",
            field="--instance",
        )
    return urlsplit(url)


def _pair(fields: Mapping[str, str]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(protocol, decode URLs, prefill URLs) of a prefill/decode pair; ("", (), ()) for one
    server.

    Raises:
        InputError: a pair key without the others, ``url=`` with a pair, a bad URL.
    """
    pd = fields.get("pd", "")
    named = [k for k in ("prefill", "decode", "bootstrap_port") if k in fields]
    if not pd:
        if named:
            raise InputError(
                f"{named[0]}= needs pd=sglang|vllm. To fix: e.g. --instance pd=sglang,"
                "prefill=http://10.0.0.1:30000,decode=http://10.0.0.2:30000",
                field="--instance",
            )
        return "", (), ()
    if pd not in PD_PROTOCOLS:
        raise InputError(
            f"pd {pd!r} is unknown; use one of {', '.join(PD_PROTOCOLS)}", field="--instance"
        )
    if "url" in fields:
        raise InputError(
            "url= and pd= exclude each other (a pair has prefill= and decode= URLs)",
            field="--instance",
        )
    if "deployment" in fields:
        raise InputError(
            "deployment= with pd= is not supported yet: give the pair's ranks= or weights=",
            field="--instance",
        )
    if fields.get("engine", pd) != pd:
        raise InputError(f"engine= must be {pd!r} for pd={pd}", field="--instance")
    sides: list[tuple[str, ...]] = []
    for key in ("decode", "prefill"):
        urls = tuple(u.strip().rstrip("/") for u in fields.get(key, "").split("+"))
        if not any(urls):
            raise InputError(
                f"pd={pd} needs {key}=URL[+URL...]. To fix: e.g. {key}=http://10.0.0.1:30000",
                field="--instance",
            )
        for u in urls:
            _http_url(u, key)
        sides.append(urls)
    if pd != "sglang" and "bootstrap_port" in fields:
        raise InputError("bootstrap_port= is for pd=sglang only", field="--instance")
    return pd, sides[0], sides[1]


def _port(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 0 < n < 65536:
        raise InputError(
            f"bootstrap_port {value!r} must be an integer in 1..65535", field="--instance"
        )
    return n


def _weights(text: str) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        values = tuple(float(v) for v in text.split(":"))
    except ValueError:
        values = (-1.0,)
    if not all(v >= 0 and math.isfinite(v) for v in values) or not any(values):
        raise InputError(
            f"weights {text!r} must be numbers >= 0 separated by ':' (not all 0)",
            field="--instance",
        )
    return values


def _positive_int(value: str, key: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise InputError(f"{key} {value!r} must be an integer >= 1", field="--instance")
    return n


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of ``--listen``.

    Raises:
        InputError: not HOST:PORT with a port in 0..65535.
    """
    host, sep, port = text.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not sep or not host or not 0 <= p <= 65535:
        raise InputError(
            f"{text!r} is not HOST:PORT. To fix: e.g. --listen 0.0.0.0:8000", field="--listen"
        )
    return host.strip("[]"), p


def read_key_tiers(path: str) -> dict[str, str]:
    """The ``--api-key-tiers`` file: a JSON object ``{api_key: tier}``.

    Raises:
        InputError: unreadable, not JSON, or not an object of strings.
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read {path!r}: {exc}", field="--api-key-tiers") from exc
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.items()
    ):
        raise InputError(
            f"{path!r} must hold a JSON object of API key -> tier name strings",
            field="--api-key-tiers",
        )
    return doc


def _check_sources(settings: RouterSettings) -> None:
    """Some instance or watched deployment; each deployment watched once, with a controller.

    Raises:
        InputError: naming the flag.
    """
    if not settings.instances and not settings.watched:
        raise InputError(
            "no engine instance. To fix: give --instance url=http://HOST:PORT or "
            "--deployment NAME (repeatable)",
            field="--instance",
        )
    watched = [w.name for w in settings.watched]
    twice = sorted({n for n in watched if watched.count(n) > 1})
    if twice:
        raise InputError(f"deployment(s) {', '.join(twice)} given twice", field="--deployment")
    if watched and not settings.controller:
        raise InputError(
            "--deployment needs a controller. To fix: give --controller HOST:PORT (or env "
            "MIXFLEET_CONTROLLER)",
            field="--controller",
        )


def check(settings: RouterSettings) -> RouterSettings:
    """Cross-field checks.

    Raises:
        InputError: no instance, duplicate names, a tier of a key map that no instance
            serves, a deployment without a controller, non-positive limits.
    """
    _check_sources(settings)
    names = [i.name for i in settings.instances]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InputError(
            f"instance name(s) {', '.join(dup)} used twice. To fix: give each a name=",
            field="--instance",
        )
    if settings.deployments and not settings.controller:
        raise InputError(
            "an instance names a deployment but no controller is set. To fix: give "
            "--controller HOST:PORT (or env MIXFLEET_CONTROLLER)",
            field="--controller",
        )
    if settings.default_tier not in settings.tiers:
        raise InputError(
            f"tier {settings.default_tier!r} has no instance. To fix: give an instance "
            "tier=... of it, or set --default-tier to one of " + ", ".join(sorted(settings.tiers)),
            field="--default-tier",
        )
    for flag, mapping in (
        ("--api-key-tiers", settings.api_key_tiers),
        ("--priority-tier", settings.priority_tiers),
    ):
        bad = sorted(set(mapping.values()) - settings.tiers)
        if bad:
            raise InputError(f"tier(s) {', '.join(bad)} have no instance", field=flag)
    for name in (
        "queue_limit",
        "max_attempts",
        "eject_after",
        "readmit_after",
        "max_body_bytes",
        "max_inflight_body_bytes",
        "max_output_tokens",
        "max_json_depth",
        "batch_queue",
    ):
        if getattr(settings, name) < 1:
            raise InputError("must be >= 1", field="--" + name.replace("_", "-"))
    for name in (
        "health_timeout_s",
        "connect_timeout_s",
        "read_timeout_s",
        "header_timeout_s",
        "body_timeout_s",
        "idle_timeout_s",
        "batch_wait_s",
        "traffic_report_s",
    ):
        value = getattr(settings, name)
        if not (value > 0 and math.isfinite(value)):
            raise InputError(
                f"must be > 0 seconds, got {value}", field="--" + name.replace("_", "-")
            )
    if not settings.reporter:
        raise InputError("must not be empty", field="--reporter")
    if settings.max_inflight_body_bytes < settings.max_body_bytes:
        raise InputError(
            f"{settings.max_inflight_body_bytes} is below --max-body-bytes "
            f"({settings.max_body_bytes}): no body of the largest size could be accepted",
            field="--max-inflight-body-bytes",
        )
    return settings
