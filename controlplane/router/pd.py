"""Driving a prefill/decode pair (an instance given with ``pd=``) the way its engine expects.

* ``sglang``, as SGLang's own router does in PD mode (sgl-project/sglang,
  ``sgl-router/py_src/sglang_router/mini_lb.py``: ``_forward_to_backend``,
  ``handle_generate_request``, ``MiniLoadBalancer.generate`` / ``generate_stream``,
  ``_generate_bootstrap_room``, ``maybe_wrap_ipv6_address``): the same request goes to a
  prefill and a decode server at once, both carrying ``bootstrap_host`` (the prefill
  server's host, an IPv6 address in brackets), ``bootstrap_port`` (its
  ``--disaggregation-bootstrap-port``) and ``bootstrap_room`` (a random integer in
  [0, 2**63) that pairs the two sides' KV transfer); a batched ``/generate`` (``text`` or
  ``input_ids`` a list of prompts) gets one of each per prompt. The client gets the decode
  server's answer. The DP
  rank the router picked is set on the decode request only; a request whose prefill side
  is pinned (the client sent ``routed_dp_rank``) also carries ``disagg_prefill_dp_rank``,
  without which SGLang 0.5.23's KV sender refuses a rank other than ``bootstrap_room mod
  DP size`` (``srt/disaggregation/common/conn.py``, ``CommonKVSender``).
* ``vllm``, as vLLM's proxy for ``NixlConnector`` does (vllm-project/vllm,
  ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``: ``_handle_completions``,
  ``send_request_to_service``, ``stream_service_response``): first the prefill request,
  with ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
  "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
  "remote_port": null}``, ``stream: false``, ``max_tokens: 1`` (and
  ``max_completion_tokens: 1`` when set), no ``stream_options``, ``min_tokens`` or
  ``min_completion_tokens``; then the decode request, the client's own, carrying the
  ``kv_transfer_params`` the prefill answer returned (when it returned a non-empty object;
  else the decode server prefills itself). Both carry one ``X-Request-Id`` (the client's,
  else a new UUID). The DP rank goes in the decode request's ``X-data-parallel-rank``
  header.

A prefill side that cannot be reached or answers 5xx fails the pair as an unreachable
engine does (the router may try another instance, then answers 502); a 4xx of the prefill
side (a request the engine refuses) is the client's answer as the engine gave it.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from controlplane.router.requests import pin_rank
from controlplane.router.settings import InstanceSpec

#: The ``kv_transfer_params`` of a vLLM prefill request (toy_proxy_server.py).
VLLM_PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: Body fields of SGLang's rank pin (current name first; ``data_parallel_rank`` deprecated).
_SGLANG_RANK = ("routed_dp_rank", "data_parallel_rank")


class PairError(Exception):
    """One side of a pair failed before anything went to the client.

    Attributes:
        status: the prefill server's 4xx status (its answer is the client's), else 0 (the
            side was unreachable or answered 5xx: the request may go elsewhere).
        body: the engine's answer to a 4xx, bytes.
    """

    def __init__(self, message: str, *, status: int = 0, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


async def open_pair(
    session: aiohttp.ClientSession,
    spec: InstanceSpec,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    rank: int,
    turn: int,
) -> aiohttp.ClientResponse:
    """Send a request through the pair ``spec`` (module docstring); returns the decode
    server's response, unread (the caller relays it and closes it).

    Args:
        path: the endpoint (``/v1/completions`` ...), the same on both sides.
        body: the client's parsed JSON body (not modified).
        headers: headers to forward (no Content-Length).
        rank: the decode server's DP rank to pin.
        turn: picks the prefill and decode URL of the sets (round robin).

    Raises:
        PairError: a side failed before the decode answer's head came back.
    """
    side = turn % len(spec.prefill)
    prefill = spec.prefill[side]
    decode = spec.decode[turn % len(spec.decode)]
    if spec.pd == "sglang":
        port = spec.bootstrap_ports[side] if spec.bootstrap_ports else spec.bootstrap_port
        return await _sglang(session, port, prefill, decode, path, body, headers, rank)
    dheaders = dict(headers)
    if not any(k.lower() == "x-request-id" for k in dheaders):
        dheaders["X-Request-Id"] = str(uuid.uuid4())
    kv = await _vllm_prefill(session, prefill + path, body, dheaders)
    dbody = {**body, "kv_transfer_params": kv} if kv else dict(body)
    pin_rank("vllm", dbody, dheaders, rank)
    return await _post(session, decode + path, dbody, dheaders, "decode")


async def _sglang(
    session: aiohttp.ClientSession,
    bootstrap_port: int,
    prefill: str,
    decode: str,
    path: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    rank: int,
) -> aiohttp.ClientResponse:
    """Both sides at once; the decode response once the prefill side answered well."""
    host = urlsplit(prefill).hostname or ""
    host = f"[{host}]" if ":" in host else host
    batch = _batch_size(body) if path == "/generate" else None
    common: dict[str, Any] = {**body}
    if batch is None:
        common.update(
            bootstrap_host=host,
            bootstrap_port=bootstrap_port,
            bootstrap_room=random.getrandbits(63),
        )
    else:
        common.update(
            bootstrap_host=[host] * batch,
            bootstrap_port=[bootstrap_port] * batch,
            bootstrap_room=[random.getrandbits(63) for _ in range(batch)],
        )
    pbody = dict(common)
    pinned = next((pbody[f] for f in _SGLANG_RANK if f in pbody), None)
    if isinstance(pinned, int):
        pbody["disagg_prefill_dp_rank"] = pinned
    dbody, dheaders = dict(common), dict(headers)
    for f in _SGLANG_RANK:
        dbody.pop(f, None)
    pin_rank("sglang", dbody, dheaders, rank)
    decoding = asyncio.ensure_future(_post(session, decode + path, dbody, dheaders, "decode"))
    try:
        answer = await _post(session, prefill + path, pbody, headers, "prefill")
        async with answer:
            await _check(answer, "prefill", prefill)
            await answer.read()
    except BaseException:
        decoding.cancel()
        done = await asyncio.gather(decoding, return_exceptions=True)
        if isinstance(done[0], aiohttp.ClientResponse):
            done[0].close()
        raise
    return await decoding


def _batch_size(body: Mapping[str, Any]) -> int | None:
    """Prompts of a batched ``/generate`` (mini_lb's ``_get_request_batch_size``); None =
    one prompt."""
    text = body.get("text")
    if text is not None:
        return None if isinstance(text, str) else len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and not isinstance(ids[0], int):
        return len(ids)
    return None


async def _vllm_prefill(
    session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], headers: Mapping[str, str]
) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` the prefill side returns (None: none)."""
    pbody = {**body, "kv_transfer_params": dict(VLLM_PREFILL_PARAMS), "stream": False}
    pbody["max_tokens"] = 1
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        pbody.pop(key, None)
    answer = await _post(session, url, pbody, headers, "prefill")
    async with answer:
        await _check(answer, "prefill", url)
        try:
            doc = json.loads(await answer.read())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise PairError(f"prefill {url}: no JSON answer ({exc!r})") from exc
    kv = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    return kv if isinstance(kv, dict) else None


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    side: str,
) -> aiohttp.ClientResponse:
    try:
        return await session.post(url, data=json.dumps(body).encode(), headers=headers)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise PairError(f"{side} {url}: {exc!r}") from exc


async def _check(answer: aiohttp.ClientResponse, side: str, url: str) -> None:
    """Raise :class:`PairError` for an answer other than 2xx."""
    if answer.status < 300:
        return
    try:
        text = await answer.read()
    except (aiohttp.ClientError, OSError, TimeoutError):
        text = b""
    status = answer.status if 400 <= answer.status < 500 else 0
    detail = text[:200].decode("utf-8", "replace")
    raise PairError(f"{side} {url}: HTTP {answer.status} {detail}", status=status, body=text)
