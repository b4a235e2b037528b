"""The router's pure parts: the choice of a rank, the weights, the request parsing and the
flags (one ``error:`` line each)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from mixfleet.v1 import engine_pb2

from controlplane.cli import main
from controlplane.router.balance import RankState, choose, effective_weights, shares
from controlplane.router.requests import estimate_work, pick_tier, pin_rank, pinned_body
from controlplane.router.settings import InstanceSpec
from controlplane.router.state import RouterState, rank_weights
from policies.errors import InputError


def _ranks(weights: list[float]) -> list[RankState]:
    return [RankState("i", r, "t", w) for r, w in enumerate(weights)]


def test_idle_choices_give_exact_weighted_shares() -> None:
    ranks = _ranks([3.0, 1.0, 2.0])
    for _ in range(600):
        c = choose(ranks, 10, queue_limit=8, healthy={"i"})
        assert c.rank is not None
        c.rank.acquire(10)
        c.rank.release(10)
    planned, achieved = shares(ranks)
    assert achieved == pytest.approx(planned, abs=1e-9)


def test_shares_hold_at_any_concurrency_with_ranks_of_equal_speed() -> None:
    rng = random.Random(7)
    weights = [0.33] * 8 + [1.3] * 8 + [1.37] * 8  # the mixed-24 plan's shape
    for clients in (1, 12, 48, 200):
        ranks = _ranks(weights)
        open_: list[tuple[RankState, float]] = []
        for _ in range(4000):
            c = choose(ranks, 72, queue_limit=10_000, healthy={"i"})
            assert c.rank is not None
            c.rank.acquire(72)
            open_.append((c.rank, 72))
            if len(open_) >= clients:  # steady load: a random open request ends
                r, w = open_.pop(rng.randrange(len(open_)))
                r.release(w)
        planned, achieved = shares(ranks)
        assert max(abs(a - p) for a, p in zip(achieved, planned, strict=True)) < 0.005, clients


def test_a_rank_that_does_not_drain_is_skipped_after_slack_requests() -> None:
    ranks = _ranks([1.0, 1.0, 1.0])
    stuck = ranks[0]
    for _ in range(300):
        c = choose(ranks, 100, queue_limit=10_000, healthy={"i"})
        assert c.rank is not None
        c.rank.acquire(100)
        if c.rank is not stuck:
            c.rank.release(100)  # the others finish at once; rank 0 never does
    assert stuck.open_requests <= 3 and stuck.routed_requests <= 3


def test_unhealthy_excluded_and_full_ranks_are_skipped() -> None:
    ranks = [RankState("a", 0, "t", 1.0), RankState("b", 0, "t", 1.0), RankState("c", 0, "t", 0.0)]
    assert choose(ranks, 1, queue_limit=1, healthy={"b", "c"}).rank is ranks[1]
    assert choose(ranks, 1, queue_limit=1, healthy={"a", "b"}, exclude={"a"}).rank is ranks[1]
    ranks[1].acquire(1)
    c = choose(ranks, 1, queue_limit=1, healthy={"b", "c"})
    assert c.rank is None and c.reason == "overloaded"
    assert choose(ranks, 1, queue_limit=1, healthy={"c"}).reason == "no_rank"


def test_effective_weights_scale_each_instance_to_its_share() -> None:
    assert effective_weights([1.0, 3.0], 2) == [0.5, 1.5]
    assert effective_weights([float("nan"), -1.0, 2.0], 3) == [0.0, 0.0, 3.0]
    assert effective_weights([0.0, 0.0], 2) == [0.0, 0.0]


def test_rank_weights_merge_gpus_of_one_attention_group() -> None:
    r = engine_pb2.Routing(dp_weights=[1.2, 1.2, 0.6, 0.6, 0.4], dp_ranks=[0, 0, 1, 1, 2])
    assert rank_weights(r) == pytest.approx([1.2, 0.6, 0.4])
    assert rank_weights(engine_pb2.Routing(dp_weights=[1.0, 2.0])) == [1.0, 2.0]


def test_a_new_version_keeps_open_counts_and_restarts_achieved_shares() -> None:
    state = RouterState.from_specs([InstanceSpec("e", "http://h:1", "t", deployment="d")])
    assert state.tiers["t"] == []  # no routing yet: nothing to route to
    state.apply_routing(engine_pb2.Routing(deployment="d", version=1, dp_weights=[1.0, 1.0]))
    r0 = state.tiers["t"][0]
    r0.acquire(100)
    assert state.apply_routing(
        engine_pb2.Routing(deployment="d", version=2, dp_weights=[1.5, 0.5], engine="vllm")
    ) == ["e"]
    assert state.tiers["t"][0] is r0 and r0.open_requests == 1 and r0.routed_tokens == 0
    assert [r.weight for r in state.tiers["t"]] == [1.5, 0.5]
    assert state.instances["e"].engine == "vllm"


def test_static_weights_set_the_ranks() -> None:
    from controlplane.router.settings import parse_instance

    spec = parse_instance("url=http://h:1,weights=3:1", "t")
    assert (spec.ranks, spec.weights) == (2, (3.0, 1.0))
    state = RouterState.from_specs([spec])
    assert [r.weight for r in state.tiers["t"]] == [1.5, 0.5]  # scaled to the rank count


def test_work_estimate_per_endpoint() -> None:
    def count(text: str) -> int:
        return len(text.split())

    chat = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}],
        "max_completion_tokens": 7,
        "stream": True,
    }
    w = estimate_work("/v1/chat/completions", chat, count, 99)
    assert (w.prompt_tokens, w.output_tokens, w.stream) == (3, 7, True)
    w = estimate_work("/v1/completions", {"prompt": [1, 2, 3, 4]}, count, 99)
    assert (w.prompt_tokens, w.output_tokens) == (4, 99)
    # A null max_completion_tokens leaves the engines max_tokens; /v1/completions knows
    # max_tokens only (vLLM 0.33 and SGLang 0.5.23 ignore the chat field there).
    both: dict[str, Any] = {"messages": [], "max_completion_tokens": None, "max_tokens": 9}
    assert estimate_work("/v1/chat/completions", both, count, 99).output_tokens == 9
    chat_only = {"prompt": "x", "max_completion_tokens": 10**11, "max_tokens": 3}
    assert estimate_work("/v1/completions", chat_only, count, 99).output_tokens == 3
    w = estimate_work(
        "/generate", {"text": "x y", "sampling_params": {"max_new_tokens": 5}}, count, 99
    )
    assert w.tokens == 7


def test_tier_from_header_api_key_priority_class_or_default() -> None:
    def tier(headers: dict[str, str]) -> str:
        return pick_tier(
            headers,
            tiers={"batch", "interactive"},
            api_key_tiers={"k1": "interactive"},
            priority_tiers={"high": "interactive"},
            default_tier="batch",
        )

    assert tier({"X-Mixfleet-Tier": "interactive"}) == "interactive"
    assert tier({"Authorization": "Bearer k1"}) == "interactive"
    assert tier({"X-Priority-Class": "high"}) == "interactive"
    assert tier({}) == "batch"
    with pytest.raises(InputError, match="X-Mixfleet-Tier"):
        tier({"X-Mixfleet-Tier": "gold"})


def test_rank_goes_where_each_engine_reads_it() -> None:
    for engine, body_key, header in (
        ("sglang", "routed_dp_rank", None),
        ("vllm", None, "X-data-parallel-rank"),
    ):
        body: dict[str, object] = {"data_parallel_rank": 9}
        headers: dict[str, str] = {}
        pin_rank(engine, body, headers, 3)
        if body_key:
            assert body[body_key] == 3 and not headers
        else:
            assert headers[header or ""] == "3"
    body = {"data_parallel_rank": 9}
    pin_rank("sglang", body, {}, 2)
    assert body == {"routed_dp_rank": 2}  # the deprecated alias cannot override
    body, headers = {"model": "m"}, {}
    pin_rank("trtllm", body, headers, 1)  # trtllm-serve has no rank field and forbids extras
    assert body == {"model": "m"} and not headers


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "hi", "stream": true}',
        b"{}",
        b"  { }\r\n\t ",
        b'{"prompt": "caf\xc3\xa9 }", "nested": {"a": [1, {"b": "}"}]}}\n',
        b'{"prompt": "x", "data_parallel_rank": 9}',  # the alias must go
        b'{"routed\\u005fdp_rank": 7, "prompt": "x"}',  # an escaped name is the same field
        '{"prompt": "utf-16"}'.encode("utf-16"),
        b'\xef\xbb\xbf{"prompt": "bom"}',
    ],
)
def test_forwarded_body_is_the_parsed_body_with_the_rank(raw: bytes) -> None:
    """What the engine parses is exactly what :func:`pin_rank` makes of the parsed body,
    whether the bytes were appended to or serialised again."""
    for engine in ("sglang", "vllm", "native", "trtllm"):
        body = json.loads(raw)
        want_body, want_headers = json.loads(raw), {"Accept": "*/*"}
        pin_rank(engine, want_body, want_headers, 5)
        headers = {"Accept": "*/*"}
        sent = pinned_body(engine, raw, body, headers, 5)
        assert json.loads(sent) == want_body
        assert headers == want_headers
        if engine != "sglang":
            assert sent is raw  # header engines: the client's bytes, untouched


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([], "--instance"),
        (["--instance", "url=ftp://h"], "--instance"),
        (["--instance", "url=http://h:1,colour=red"], "--instance"),
        (["--instance", "url=http://h:1,share=0"], "--instance"),
        (["--instance", "url=http://h:1,engine=tgi"], "--instance"),
        (["--instance", "url=http://h:1,weights=1:x"], "--instance"),
        (["--instance", "url=http://h:1,weights=1:2,deployment=d"], "--instance"),
        (["--instance", "url=http://h:1,deployment=d"], "--controller"),
        (["--instance", "url=http://h:1,tier=batch"], "--default-tier"),
        (["--instance", "url=http://h:1", "--instance", "url=http://h:1"], "--instance"),
        (["--instance", "url=http://h:1", "--listen", "x"], "--listen"),
        (["--instance", "url=http://h:1", "--max-attempts", "0"], "--max-attempts"),
        (["--instance", "url=http://h:1", "--priority-tier", "x"], "--priority-tier"),
        (["--instance", "url=http://h:1", "--api-key-tiers", "/nonexistent"], "--api-key-tiers"),
        (["--instance", "url=http://h:1", "--tls-cert", "c.pem"], "--tls-cert"),
    ],
)
def test_bad_flags_give_one_error_line(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["router", "run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith((f"error: {flag}", f"error: argument {flag}")), err


def test_api_key_tier_file_must_name_served_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"k": "gold"}))
    assert main(["router", "run", "--instance", "url=http://h:1", "--api-key-tiers", str(f)]) == 2
    assert capsys.readouterr().err.startswith("error: --api-key-tiers: tier(s) gold")


def test_status_of_a_router_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "status", "--router", "http://127.0.0.1:9", "--timeout", "1"]) == 1
    assert capsys.readouterr().err.startswith("error: cannot read http://127.0.0.1:9/router/status")


def test_dp_ranks_number_attention_groups_in_order_of_first_appearance() -> None:
    from types import SimpleNamespace

    from controlplane.wire.plans import dp_ranks

    groups = [3, 3, None, 1, 1, None]
    plan = SimpleNamespace(gpus=[SimpleNamespace(dp_group=g) for g in groups])
    assert dp_ranks(plan) == [0, 0, 1, 2, 2, 3]  # type: ignore[arg-type]
