"""Prefill/decode pairs behind the router: real router, real loopback engines in each role,
for each protocol (SGLang's bootstrap room, vLLM's kv_transfer_params); the ``--instance``
syntax of a pair."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from router_world import complete, running_router
from support.openai_engine import LoopbackEngine

from controlplane.router.settings import DEFAULT_BOOTSTRAP_PORT, InstanceSpec, parse_instance
from policies.errors import InputError

_MAIN = "import sys; from controlplane.cli.router import main; sys.exit(main(sys.argv[1:]))"


@asynccontextmanager
async def pair(protocol: str) -> AsyncIterator[tuple[LoopbackEngine, LoopbackEngine, InstanceSpec]]:
    """A prefill and a decode loopback engine of ``protocol`` and the instance naming them."""
    p = await LoopbackEngine(engine=protocol, role="prefill", pd_wait_s=5.0).start()
    d = await LoopbackEngine(engine=protocol, role="decode", pd_wait_s=5.0).start()
    extra = f",bootstrap_port={p.port}" if protocol == "sglang" else ""
    spec = parse_instance(f"name=pd,pd={protocol},prefill={p.url},decode={d.url}{extra}", "default")
    try:
        yield p, d, spec
    finally:
        await p.stop()
        await d.stop()


def _chunks(text: str) -> list[dict[str, object]]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: {")  # the [DONE] line is not JSON
    ]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_streamed_request_through_a_pair(protocol: str) -> None:
    async def main() -> None:
        async with (
            pair(protocol) as (p, d, spec),
            running_router(instances=(spec,)) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            status, text = await complete(s, url, max_tokens=6, stream=True)
        assert status == 200, text
        chunks = _chunks(text)
        assert len(chunks) == 6 and text.rstrip().endswith("data: [DONE]")
        assert [r.done for r in d.records] == [True]  # the decode side streamed it
        assert [r.tokens for r in p.records] == [] and len(p.pd_seen) == 1
        ps, ds = p.pd_seen[0], d.pd_seen[0]
        if protocol == "sglang":
            for key in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
                assert ps[key] == ds[key], key
            assert ps["bootstrap_port"] == p.port and ps["bootstrap_host"] == "127.0.0.1"
            assert ds["routed_dp_rank"] == 0 and "routed_dp_rank" not in ps
            assert ds["stream"] is True and ds["max_tokens"] == 6
        else:
            kv = ps["kv_transfer_params"]
            assert isinstance(kv, dict)
            assert (kv["do_remote_decode"], kv["do_remote_prefill"]) == (True, False)
            assert ps["max_tokens"] == 1 and ps["stream"] is False
            got = ds["kv_transfer_params"]
            assert isinstance(got, dict)
            assert got["do_remote_prefill"] is True and got["remote_port"] == p.port
            assert ds["stream"] is True and ds["max_tokens"] == 6

    asyncio.run(main())


def test_sglang_rooms_differ_and_a_client_pin_reaches_the_prefill_side() -> None:
    async def main() -> None:
        async with (
            pair("sglang") as (p, _, spec),
            running_router(instances=(spec,)) as router,
            aiohttp.ClientSession() as s,
        ):
            url = f"http://127.0.0.1:{router.port}"
            for _ in range(3):
                assert (await complete(s, url))[0] == 200
            body = {"prompt": "x", "max_tokens": 2, "routed_dp_rank": 0}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        rooms = {seen["bootstrap_room"] for seen in p.pd_seen}
        assert len(rooms) == 4
        assert p.pd_seen[-1]["disagg_prefill_dp_rank"] == 0
        assert all("disagg_prefill_dp_rank" not in seen for seen in p.pd_seen[:3])

    asyncio.run(main())


def test_sglang_batch_gets_a_room_per_prompt_and_vllm_sides_share_a_request_id() -> None:
    async def main() -> None:
        async with (
            pair("sglang") as (p, d, spec),
            running_router(instances=(spec,)) as router,
            aiohttp.ClientSession() as s,
        ):
            body = {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}}
            async with s.post(f"http://127.0.0.1:{router.port}/generate", json=body) as r:
                assert r.status == 200, await r.text()
        rooms = p.pd_seen[0]["bootstrap_room"]
        assert isinstance(rooms, list) and len(set(rooms)) == 3
        assert d.pd_seen[0]["bootstrap_room"] == rooms
        assert p.pd_seen[0]["bootstrap_port"] == [p.port] * 3
        async with (
            pair("vllm") as (p, d, spec),
            running_router(instances=(spec,)) as router,
            aiohttp.ClientSession() as s,
        ):
            vbody = {"prompt": "x", "max_tokens": 3, "min_tokens": 2}
            async with s.post(f"http://127.0.0.1:{router.port}/v1/completions", json=vbody) as r:
                assert r.status == 200, await r.text()
        ps, ds = p.pd_seen[0], d.pd_seen[0]
        assert ps["request_id"] and ps["request_id"] == ds["request_id"]
        assert "min_tokens" not in ps and ds["min_tokens"] == 2

    asyncio.run(main())


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("failure", ["500", "400", "down"])
def test_a_prefill_failure_is_one_clean_error(protocol: str, failure: str) -> None:
    async def main() -> None:
        async with pair(protocol) as (p, d, spec), running_router(instances=(spec,)) as router:
            if failure == "down":
                p.kill()
            else:
                p.fail_status = int(failure)
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}"
                status, text = await complete(s, url, max_tokens=4, stream=True)
        doc = json.loads(text)  # one JSON error, not a stream
        assert "error" in doc, text
        if failure == "400":
            assert status == 400 and "injected failure" in text
        else:
            assert status == 502 and "prefill" in doc["error"]["message"]
        assert not any(r.done for r in d.records)  # nothing decoded for the client

    asyncio.run(main())


def test_shares_across_a_pair_and_an_aggregated_instance_follow_the_weights() -> None:
    async def main() -> None:
        agg = await LoopbackEngine(engine="vllm").start()
        try:
            async with pair("vllm") as (p, d, spec):
                pd = InstanceSpec(**{**spec.__dict__, "share": 3.0})
                one = InstanceSpec(name="agg", url=agg.url, tier="default", share=1.0)
                async with running_router(instances=(pd, one)) as router:
                    url = f"http://127.0.0.1:{router.port}"
                    async with aiohttp.ClientSession() as s:
                        for _ in range(80):
                            assert (await complete(s, url, max_tokens=1))[0] == 200
        finally:
            await agg.stop()
        via_pair, direct = len(d.records), len(agg.records)
        assert via_pair + direct == 80 and len(p.pd_seen) == via_pair
        assert abs(via_pair / 80 - 0.75) <= 0.1, (via_pair, direct)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pd=sglang,decode=http://a:1", "needs prefill="),
        ("pd=vllm,prefill=http://a:1", "needs decode="),
        ("pd=foo,prefill=http://a:1,decode=http://b:2", "pd 'foo' is unknown"),
        ("url=http://a:1,pd=sglang,prefill=http://a:1,decode=http://b:2", "exclude each other"),
        ("prefill=http://a:1,decode=http://b:2", "needs pd=sglang|vllm"),
        ("pd=sglang,prefill=ftp://a:1,decode=http://b:2", "prefill 'ftp://a:1'"),
        ("pd=sglang,prefill=http://a:1+,decode=http://b:2", "prefill ''"),
        ("pd=sglang,prefill=http://a:1,decode=http://b:2,bootstrap_port=0", "bootstrap_port"),
        ("pd=vllm,prefill=http://a:1,decode=http://b:2,bootstrap_port=9", "pd=sglang only"),
        ("pd=vllm,prefill=http://a:1,decode=http://b:2,engine=sglang", "engine= must be"),
        ("pd=vllm,prefill=http://a:1,decode=http://b:2,deployment=x", "not supported yet"),
    ],
)
def test_bad_pair_specs_are_refused(text: str, expected: str) -> None:
    with pytest.raises(InputError) as err:
        parse_instance(text, "default")
    assert expected in str(err.value) and err.value.field == "--instance"


def test_pair_spec_parsed() -> None:
    spec = parse_instance("pd=sglang,prefill=http://a:1+http://b:2/,decode=http://c:3", "t")
    assert (spec.pd, spec.engine, spec.url) == ("sglang", "sglang", "http://c:3")
    assert spec.prefill == ("http://a:1", "http://b:2") and spec.decode == ("http://c:3",)
    assert spec.bootstrap_port == DEFAULT_BOOTSTRAP_PORT and spec.name == "c:3"
    plain = parse_instance("url=http://a:1", "t")  # unchanged for one server
    assert (plain.pd, plain.prefill, plain.decode) == ("", (), ())


def test_cli_refuses_a_bad_pair_with_one_error_line() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _MAIN, "--instance", "pd=vllm"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), out.stderr
