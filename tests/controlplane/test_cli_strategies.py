"""``mixfleetctl advise batch|context|tiers`` and ``plan cost|min-cost`` run in-process:
outputs, files, exit statuses and input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_builders import RunCli, cli_runner, write_fleet

TINY_MODEL = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}
QUICK = ["--time-limit", "5", "--workers", "1", "-q"]


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture
def inputs(tmp_path: Path) -> list[str]:
    model_dir = tmp_path / "tiny-qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_MODEL))
    fleet = write_fleet(tmp_path)
    return ["--fleet", str(fleet), "--model-config", str(model_dir / "config.json")]


def test_plan_group_is_shared_with_the_local_commands(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "--help")
    assert code == 0
    for action in ("solve", "compare", "cost", "min-cost"):
        assert action in out


def test_advise_batch_prints_the_curve_and_draws_it(
    run_cli: RunCli, inputs: list[str], tmp_path: Path
) -> None:
    png = tmp_path / "out" / "batch.png"
    code, out, err = run_cli("advise", "batch", *inputs, *QUICK, "--tpot-ms", "1", "--png", png)
    assert code == 0, err
    assert "LARGEST" in out and "largest:" in out and "TPOT <= 1 ms" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run_cli("advise", "batch", *inputs, *QUICK, "--tpot-ms", "1", "-o", "json")
    doc = json.loads(out)
    assert doc["target"] == "TPOT" and doc["best"]["step_time_ms"] <= 1.0
    assert doc["largest_tokens_per_gpu"] == doc["best"]["tokens_per_gpu"]


def test_advise_batch_errors(run_cli: RunCli, inputs: list[str]) -> None:
    code, _, err = run_cli(
        "advise", "batch", *inputs, *QUICK, "--phase", "prefill", "--tpot-ms", "5"
    )
    assert code == 2 and "TPOT is a decode target. To fix" in err
    code, out, err = run_cli("advise", "batch", *inputs, *QUICK, "--tpot-ms", "0.001")
    assert code == 3 and "INFEASIBLE" in out
    assert "error: infeasible: no batch size works" in err and "To fix" in err


def test_advise_context_reports_each_policy(run_cli: RunCli, inputs: list[str]) -> None:
    code, out, err = run_cli(
        "advise",
        "context",
        *inputs,
        *QUICK,
        "--tokens",
        "64",
        "--contexts",
        "16k,64k",
        "--policies",
        "uniform,ilp",
        "-o",
        "json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert [p["policy"] for p in doc["policies"]] == ["uniform", "ilp"]
    assert all(p["longest_context"] >= 16384 for p in doc["policies"])
    code, _, err = run_cli("advise", "context", *inputs, *QUICK, "--tokens", "8", "--contexts", "x")
    assert code == 2 and "To fix: write e.g. 32k" in err


def test_advise_tiers_met_and_unmet(run_cli: RunCli, inputs: list[str]) -> None:
    base = ["advise", "tiers", *inputs, *QUICK, "--tpot-ms", "1", "--ttft-ms", "20"]
    code, out, err = run_cli(*base, "--rate", "10", "--prompt-tokens", "512")
    assert code == 0, err
    assert "SLO met" in out and "interactive (fastest)" in out
    code, out, err = run_cli(*base, "--rate", "1e7", "--additions", "B200")
    assert code == 3
    assert "SLO NOT MET" in out and "node(s) of 8x B200" in out
    assert "error: infeasible: the interactive SLO cannot be met" in err and "add " in err
    code, _, err = run_cli("advise", "tiers", *inputs, *QUICK, "--rate", "1")
    assert code == 2 and "needs a latency target" in err


def test_plan_cost_with_a_price_file(run_cli: RunCli, inputs: list[str], tmp_path: Path) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text("currency: EUR\nprices:\n  A100-SXM4-80GB: 1.0\n  H100-SXM5-80GB: 2.0\n")
    args = ["plan", "cost", *inputs, *QUICK, "--tokens", "64", "--redundant-experts", "0"]
    code, out, err = run_cli(*args, "--policies", "uniform,greedy", "--prices", prices)
    assert code == 0, err
    assert "EUR/Mtok" in out and "6.000" in out  # 2x 1.0 + 2x 2.0 per hour
    code, out, _ = run_cli(*args, "--policies", "greedy", "-o", "json")
    row = json.loads(out)["policies"][0]
    assert row["usd_per_million_tokens"] == pytest.approx(
        row["usd_per_hour"] / (row["tokens_per_s"] * 3600) * 1e6
    )
    prices.write_text("prices: {L4: -1}\n")
    code, _, err = run_cli(*args, "--prices", prices)
    assert code == 2 and "prices.L4" in err


def test_plan_min_cost(run_cli: RunCli, inputs: list[str], tmp_path: Path) -> None:
    args = ["plan", "min-cost", *inputs, *QUICK, "--tokens", "64"]
    code, out, err = run_cli(
        *args, "--target-tokens-per-s", "1000", "-o", "json", "--save-plans", tmp_path / "p"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["tokens_per_s"] >= 1000 and doc["chosen"]["nodes"]
    assert len(list((tmp_path / "p").glob("*.json"))) == len(doc["plans"])
    code, _, err = run_cli(*args, "--target-tokens-per-s", "1e12")
    assert code == 3 and "To fix" in err
