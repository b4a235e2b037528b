"""The target engine on the command line: ``--engine`` and its options reach the solve
through the one engine parser, bad combinations are one ``error:`` line (exit 2), ``plan
show`` prints the plan's engine, and ``plan launch`` prints each node's command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_builders import RunCli, cli_runner

from controlplane import cli
from controlplane.cli.problem import deployment_from_args, problem_from_args
from policies.estimate.engines import EngineOptions, EngineSpec

FLEET = """\
apiVersion: mixfleet.io/v1alpha1
kind: Fleet
metadata: {name: hh}
spec:
  nodes:
  - name: h0
    gpus: [{model: H100-SXM5-80GB, count: 2}]
    nvlink: {per_gpu_bidir_gbytes_per_s: 900}
    nics: [{count: 1, per_direction_gbits_per_s: 400, fabric: ib0}]
  - name: h1
    gpus: [{model: H100-SXM5-80GB, count: 2}]
    nvlink: {per_gpu_bidir_gbytes_per_s: 900}
    nics: [{count: 1, per_direction_gbits_per_s: 400, fabric: ib0}]
"""
QWEN = ["--model", "qwen3-30b-a3b", "--tokens", "32", "--context", "2048", "--workers", "1"]


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fleet and plans solved once: greedy for sglang, vllm, trtllm and native."""
    d = tmp_path_factory.mktemp("engine")
    fleet = d / "fleet.yaml"
    fleet.write_text(FLEET)
    out = {"fleet": fleet}
    for engine in ("sglang", "vllm", "trtllm", "native"):
        path = d / f"{engine}.json"
        argv = ["plan", "solve", "--fleet", str(fleet), *QWEN, "--policy", "greedy"]
        assert cli.main([*argv, "--engine", engine, "-q", "-o", "json", "--out", str(path)]) == 0
        out[engine] = path
    return out


def one_error(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_the_engine_and_its_options_reach_the_plan(files: dict[str, Path]) -> None:
    plans = {e: json.loads(files[e].read_text())["engine"] for e in ("sglang", "vllm", "native")}
    assert plans["sglang"]["name"] == "sglang" and plans["sglang"]["version"] == "0.5.23"
    assert plans["sglang"]["dispatch"] == "static" and plans["sglang"]["a2a_backend"] == "deepep"
    assert plans["vllm"]["dispatch"] == "even"
    assert plans["native"]["name"] == "native" and plans["native"]["dispatch"] == "planned"


def test_engine_flags_are_read_by_the_one_parser(files: dict[str, Path]) -> None:
    parser = cli.build_parser()
    base = ["plan", "solve", "--fleet", str(files["fleet"]), *QWEN]
    args = parser.parse_args(
        [*base, "--engine", "sglang", "--a2a-backend", "none", "--dispatch", "dynamic"]
    )
    want = EngineSpec("sglang", options=EngineOptions("none", "dynamic", "auto"))
    assert problem_from_args(args).engine == want
    assert problem_from_args(args).engine.dp_balance == "router"  # auto, for sglang
    advise = ["advise", "batch", "--fleet", str(files["fleet"]), "--model", "qwen3-30b-a3b"]
    args = parser.parse_args(
        [*advise, "--tpot-ms", "50", "--engine", "vllm", "--dp-balance", "engine"]
    )
    assert deployment_from_args(args).engine == EngineSpec(
        "vllm", options=EngineOptions(dp_balance="engine")
    )


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--engine", "vllm", "--dispatch", "static"], ["--dispatch", "vLLM always hashes"]),
        (["--engine", "trtllm", "--a2a-backend", "mori"], ["--a2a-backend", "choose auto"]),
        (["--engine", "tgi"], ["--engine", "invalid choice"]),
        (["--engine", "sglang", "--form", "native"], ["form", "--form engine"]),
    ],
)
def test_bad_engine_flags_are_one_error_line(
    run_cli: RunCli, files: dict[str, Path], flags: list[str], needles: list[str]
) -> None:
    code, out, err = run_cli("plan", "solve", "--fleet", files["fleet"], *QWEN, *flags, "-q")
    assert code == 2 and out == ""
    one_error(err, *needles)


def test_sglang_refuses_a_model_it_cannot_place(run_cli: RunCli, files: dict[str, Path]) -> None:
    argv = ["plan", "compare", "--fleet", files["fleet"], "--model", "mixtral-8x7b"]
    argv += ["--redundant-experts", "0"]
    code, _, err = run_cli(*argv, "--engine", "sglang", "--policies", "greedy", "-q")
    assert code == 2
    one_error(err, "cannot load an expert placement for mixtral-8x7b", "--engine vllm")


def test_plan_show_prints_the_engine(run_cli: RunCli, files: dict[str, Path]) -> None:
    _, sglang, _ = run_cli("plan", "show", files["sglang"])
    assert "engine: sglang 0.5.23, a2a backend deepep (every GPU supports it), dispatch " in (
        sglang
    )
    _, native, _ = run_cli("plan", "show", files["native"])
    assert "engine: native (idealised: no engine executes these shares)" in native


def test_plan_launch_prints_each_nodes_command(run_cli: RunCli, files: dict[str, Path]) -> None:
    code, out, err = run_cli(
        "plan",
        "launch",
        "--plan",
        files["sglang"],
        "--model-path",
        "/m",
        "--dist-init-addr",
        "h0:5000",
    )
    assert code == 0 and err == ""
    assert (
        "# node h0 (node rank 0): ranks 0-1" in out and "# node h1 (node rank 1): ranks 2-3" in out
    )
    assert out.count("python3 -m sglang.launch_server") == 2
    assert (
        "CUDA_VISIBLE_DEVICES=0,1" in out and "--init-expert-location expert-location.json" in out
    )
    code, out, err = run_cli("plan", "launch", "--plan", files["vllm"], "-o", "json")
    assert code == 0
    doc = json.loads(out)
    assert [n["node"] for n in doc["nodes"]] == ["h0", "h1"]
    assert doc["nodes"][1]["argv"][-1] == "--headless"
    assert "$MIXFLEET_MODEL_PATH" in err and "$MIXFLEET_DIST_INIT_ADDR" in err


def test_plan_launch_writes_the_trtllm_options(
    run_cli: RunCli, files: dict[str, Path], tmp_path: Path
) -> None:
    options = tmp_path / "opts.yaml"
    code, out, _ = run_cli(
        "plan",
        "launch",
        "--plan",
        files["trtllm"],
        "--options-file",
        options,
        "--placement-file",
        "/p/lb.yaml",
        "--write-options",
        "-q",
    )
    assert code == 0 and f"--extra_llm_api_options {options}" in out
    assert yaml.safe_load(options.read_text())["moe_config"]["load_balancer"] == "/p/lb.yaml"


@pytest.mark.parametrize(
    ("plan", "extra", "needles"),
    [
        ("sglang", ["--engine", "vllm"], ["solved for sglang, not vllm", "--engine vllm"]),
        ("native", [], ["native (idealised: no engine executes these shares)"]),
    ],
)
def test_plan_launch_refusals(
    run_cli: RunCli, files: dict[str, Path], plan: str, extra: list[str], needles: list[str]
) -> None:
    code, out, err = run_cli("plan", "launch", "--plan", files[plan], *extra)
    assert code == 2 and out == ""
    one_error(err, *needles)


def test_strategy_questions_carry_the_engine(files: dict[str, Path]) -> None:
    """The gRPC strategy services (AdviseBatch...) plan the deployment's engine too."""
    from controlplane.server.strategies import deployment_for
    from policies.hardware.fleet import parse_fleet
    from policies.spec.build import DeploymentSpec

    fleet = parse_fleet(yaml.safe_load(FLEET))
    spec = DeploymentSpec(name="q", model="qwen3-30b-a3b", engine=EngineSpec("trtllm"))
    dep = deployment_for(spec, fleet)
    assert dep.engine == spec.engine and dep.request(32).engine == spec.engine
