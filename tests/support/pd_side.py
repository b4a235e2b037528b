"""The prefill and decode roles of :class:`support.openai_engine.LoopbackEngine`: each
checks the fields its engine needs from a router and pairs with the other side through the
prefill server's ``GET /loopback/kv/{key}`` (the KV transfer, over HTTP on loopback).

* ``sglang`` (SGLang 0.5.23 with ``--disaggregation-mode prefill|decode``): both sides need
  ``bootstrap_host`` (str), ``bootstrap_port`` (int) and ``bootstrap_room`` (int in
  [0, 2**63)); the prefill side makes room ``bootstrap_room`` ready and answers one token;
  the decode side reads the room from ``http://bootstrap_host:bootstrap_port`` (waiting for
  the prefill request if it came first), then generates.
* ``vllm`` (vLLM 0.33.0 with ``NixlConnector``): the prefill side needs ``kv_transfer_params``
  with ``do_remote_decode: true`` and ``do_remote_prefill: false``, ``max_tokens: 1`` and
  no streaming; it answers one token and ``kv_transfer_params`` naming itself
  (``do_remote_prefill: true``, ``remote_engine_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port``, ``remote_request_id``); the decode side needs those
  (``do_remote_prefill: true``), reads the KV from ``remote_host:remote_port``, then
  generates.

A request that lacks a field is refused with 400 ``{"error": {"message": ...}}``; a decode
whose KV never comes (no prefill for it within ``pd_wait_s``) gets 500.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

if TYPE_CHECKING:
    from support.openai_engine import LoopbackEngine

ROLES = ("aggregated", "prefill", "decode")
#: Fields recorded in :attr:`LoopbackEngine.pd_seen`.
PD_FIELDS = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "disagg_prefill_dp_rank",
    "routed_dp_rank",
    "kv_transfer_params",
    "max_tokens",
    "min_tokens",
    "stream",
)
_ids = itertools.count(1)


async def serve(
    engine: LoopbackEngine, request: web.Request, body: dict[str, Any]
) -> web.StreamResponse | None:
    """The answer of a prefill side, or a refusal; None: a decode side may generate."""
    seen = {k: body[k] for k in PD_FIELDS if k in body}
    engine.pd_seen.append({**seen, "request_id": request.headers.get("X-Request-Id", "")})
    if engine.engine == "sglang":
        keys, kv_url, problem = _sglang(body)
    else:
        keys, kv_url, problem = _vllm(engine.role, body)
    if problem:
        return _error(400, problem)
    key = keys[0]
    if engine.role == "prefill":
        for k in keys:
            engine.kv_ready(k)
        answer = engine.answer(request.path, "t", 1, done=True)
        if engine.engine == "vllm":
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"loopback-{engine.port}",
                "remote_block_ids": [int(key.rsplit("-", 1)[1])],
                "remote_host": "127.0.0.1",
                "remote_port": engine.port,
                "remote_request_id": key,
            }
        return web.json_response(answer)
    timeout = aiohttp.ClientTimeout(total=engine.pd_wait_s + 5)
    for k in keys:
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as s,
                s.get(f"{kv_url}/loopback/kv/{k}") as r,
            ):
                ok = r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            ok = False
        if not ok:
            return _error(500, f"the KV of {k} never came from {kv_url}")
    return None


def _sglang(body: dict[str, Any]) -> tuple[list[str], str, str]:
    """Rooms, bootstrap URL, problem; a batch carries one of each field per prompt (lists),
    one bootstrap server for all."""
    host, port, room = (body.get(k) for k in PD_FIELDS[:3])
    if isinstance(room, list):
        if not (isinstance(host, list) and isinstance(port, list) and room):
            return [], "", "a batch needs lists of bootstrap_host, bootstrap_port, bootstrap_room"
        if not len(host) == len(port) == len(room) or len({*host}) != 1 or len({*port}) != 1:
            return [], "", "the bootstrap lists differ in length or name several servers"
        host, port, rooms = host[0], port[0], room
    else:
        rooms = [room]
    if not isinstance(host, str) or not host:
        return [], "", "bootstrap_host (str) is missing"
    if not isinstance(port, int) or isinstance(port, bool):
        return [], "", "bootstrap_port (int) is missing"
    for r in rooms:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < 2**63:
            return [], "", "bootstrap_room (int in [0, 2**63)) is missing"
    return [f"room-{r}" for r in rooms], f"http://{host}:{port}", ""


def _vllm(role: str, body: dict[str, Any]) -> tuple[list[str], str, str]:
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict):
        return [], "", "kv_transfer_params (object) is missing"
    if role == "prefill":
        if kv.get("do_remote_decode") is not True or kv.get("do_remote_prefill") is not False:
            return [], "", "a prefill needs do_remote_decode: true, do_remote_prefill: false"
        if body.get("max_tokens") != 1 or body.get("stream"):
            return [], "", "a prefill needs max_tokens: 1 and no streaming"
        return [f"vllm-{next(_ids)}"], "", ""
    key, host, port = kv.get("remote_request_id"), kv.get("remote_host"), kv.get("remote_port")
    if kv.get("do_remote_prefill") is not True or not isinstance(key, str) or not host:
        return [], "", "a decode needs the prefill's kv_transfer_params (do_remote_prefill)"
    return [key], f"http://{host}:{port}", ""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)
