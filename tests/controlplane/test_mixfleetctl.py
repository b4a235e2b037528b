"""``mixfleetctl`` local commands, run in-process through ``main(argv)`` (and once as a
subprocess): outputs, exit statuses, and every input error path."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_builders import MIXTRAL_ARGS, TINY_FLEET, RunCli, cli_runner, solve_plans, write_fleet

from controlplane import cli
from controlplane.cli.files import read_plan

SUMMARY_KEYS = {
    "policy",
    "form",
    "step_time_us",
    "tokens_per_s",
    "lower_bound_us",
    "gap",
    "solve_s",
    "feasible",
}


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    return write_fleet(tmp_path)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture(scope="module")
def solved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Plans solved once for the module (see :func:`cli_builders.solve_plans`)."""
    return solve_plans(tmp_path_factory.mktemp("plans"))


def assert_one_error_line(err: str, *needles: str) -> None:
    """stderr holds exactly one ``error:`` line, no traceback, and mentions every needle."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]


# ------------------------------------------------------------------------- solve


def test_solve_json_has_the_summary(run_cli: RunCli, fleet_file: Path) -> None:
    code, out, err = run_cli(
        "plan", "solve", "--fleet", fleet_file, *MIXTRAL_ARGS, "--policy", "ilp", "-o", "json"
    )
    assert code == 0, err
    doc = json.loads(out)
    summary = doc["summary"]
    assert set(summary) >= SUMMARY_KEYS
    assert summary["policy"] == "ilp" and summary["form"] == "engine"
    assert summary["feasible"] is True
    assert summary["lower_bound_us"] <= summary["step_time_us"]
    assert 0 <= summary["gap"] < 1
    assert summary["tokens_per_s"] == pytest.approx(64 * 4 / (summary["step_time_us"] * 1e-6))
    assert doc["slots_per_gpu"] == 3 and len(doc["gpus"]) == 4
    assert doc["workload"]["load_source"] == "synthetic:zipf:1.0:seed=3"


def test_solve_reports_progress_on_stderr(run_cli: RunCli, fleet_file: Path) -> None:
    args = [a for a in MIXTRAL_ARGS if a != "-q"]
    code, out, err = run_cli("plan", "solve", "--fleet", fleet_file, *args, "--policy", "ilp")
    assert code == 0
    first, *rest = err.splitlines()
    assert first.startswith("solving ilp (engine form): mixtral-8x7b (32 MoE layers x 8 experts")
    assert "time limit 5 s" in first
    assert rest[-1].startswith("ilp: step ") and "tokens/s" in rest[-1]
    assert out.startswith("plan ") and "a100-0/gpu0" in out and "h100-0/gpu1" in out


def test_solve_yaml_and_out_file_agree(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    saved = tmp_path / "sub" / "plan.yaml"
    code, out, _ = run_cli(
        "plan",
        "solve",
        "--fleet",
        fleet_file,
        *MIXTRAL_ARGS,
        "--policy",
        "greedy",
        "-o",
        "yaml",
        "--out",
        saved,
    )
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["summary"]["policy"] == "greedy"
    assert read_plan(saved).id == printed["id"]


def test_solve_with_previous_plan_counts_moves(run_cli: RunCli, solved: dict[str, Path]) -> None:
    code, out, _ = run_cli(
        "plan",
        "solve",
        "--fleet",
        solved["fleet"],
        *MIXTRAL_ARGS,
        "--policy",
        "greedy",
        "--previous",
        solved["engine"],
        "-o",
        "json",
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["version"] == 2
    assert isinstance(doc["summary"]["expert_moves"], int)


def test_solve_native_plan(solved: dict[str, Path]) -> None:
    plan = read_plan(solved["native"])
    assert plan.form == "native" and plan.slots_per_gpu is None
    assert plan.summary.policy == "greedy"


# ------------------------------------------------------------------- show, compare


def test_show_table_and_json(run_cli: RunCli, solved: dict[str, Path]) -> None:
    code, out, _ = run_cli("plan", "show", solved["engine"])
    assert code == 0
    assert "ilp (engine form)" in out and "3 slots per GPU" in out
    assert "INVALID" not in out
    code, out, _ = run_cli("plan", "show", solved["engine"], "-o", "json")
    assert code == 0
    assert json.loads(out)["id"] == read_plan(solved["engine"]).id


def test_compare_table_side_by_side(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    code, out, err = run_cli(
        "plan",
        "compare",
        "--fleet",
        fleet_file,
        *MIXTRAL_ARGS,
        "--policies",
        "uniform,eplb,greedy,ilp",
        "--save-plans",
        tmp_path,
    )
    assert code == 0, err
    header, rule, *rows = out.strip().splitlines()
    assert header.split()[:3] == ["policy", "step", "ms"]
    assert "vs uniform" in header and "gap" in header and "feasible" in header
    assert set(rule) <= {"-", " "}
    assert [r.split()[0] for r in rows] == ["uniform", "eplb", "greedy", "ilp"]
    assert "1.000x" in rows[0]
    assert rows[3].split()[-1] == "yes" and "%" in rows[3]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "eplb.json",
        "greedy.json",
        "ilp.json",
        "uniform.json",
    ]


def test_compare_json_speedups(run_cli: RunCli, fleet_file: Path) -> None:
    code, out, _ = run_cli(
        "plan",
        "compare",
        "--fleet",
        fleet_file,
        *MIXTRAL_ARGS,
        "--policies",
        "greedy,uniform",
        "-o",
        "json",
    )
    assert code == 0
    doc = json.loads(out)
    rows = {r["policy"]: r for r in doc["policies"]}
    assert list(rows) == ["greedy", "uniform"]
    assert rows["uniform"]["speedup_vs_uniform"] == pytest.approx(1.0)
    expected = rows["greedy"]["tokens_per_s"] / rows["uniform"]["tokens_per_s"]
    assert rows["greedy"]["speedup_vs_uniform"] == pytest.approx(expected)
    assert doc["model"] == "mixtral-8x7b" and doc["redundant_experts"] == 4


# ----------------------------------------------------------------- export, render


@pytest.mark.parametrize("fmt", ["vllm", "trtllm"])
def test_export_writes_the_engine_file(
    run_cli: RunCli, solved: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    out_file = tmp_path / f"{fmt}.out"
    sidecar = tmp_path / "sidecar.json"
    code, _, err = run_cli(
        "plan", "export", solved["engine"], "--format", fmt, "--out", out_file, "--sidecar", sidecar
    )
    assert code == 0, err
    plan = read_plan(solved["engine"])
    text = out_file.read_text()
    doc = yaml.safe_load(text) if fmt == "trtllm" else json.loads(text)
    if fmt == "vllm":
        assert len(doc["physical_to_logical_map"][0]) == 8 + plan.num_redundant
        assert len(doc["logical_replica_count"][0]) == 8
    else:
        assert doc["num_slots"] == 12 and doc["layer_updates_per_iter"] == 0
        assert sorted(doc["initial_global_assignments"]) == list(range(32))  # int keys
    side = json.loads(sidecar.read_text())
    assert len(side["dp_attention_weights"]) == 4
    manifest = json.loads((tmp_path / f"{fmt}.manifest.json").read_text())
    assert manifest["file_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert [r["gpu"] for r in manifest["ranks"]] == [g.gpu for g in plan.gpus]
    assert manifest["num_redundant"] == plan.num_redundant and manifest["world_size"] == 4


def test_export_refuses_mixtral_for_sglang(
    run_cli: RunCli, solved: dict[str, Path], tmp_path: Path
) -> None:
    out_file = tmp_path / "loc.json"
    code, _, err = run_cli(
        "plan", "export", solved["engine"], "--format", "sglang", "--out", out_file
    )
    assert code == 2
    assert "get_model_config_for_expert_location" in err and "To fix" in err
    assert not out_file.exists()


def test_export_to_stdout(run_cli: RunCli, solved: dict[str, Path]) -> None:
    code, out, err = run_cli("plan", "export", solved["engine"], "--format", "trtllm")
    assert code == 0
    assert yaml.safe_load(out)["num_slots"] == 12
    assert "no manifest written" in err


def test_render_writes_a_png(run_cli: RunCli, solved: dict[str, Path], tmp_path: Path) -> None:
    png = tmp_path / "pics" / "plan.png"
    code, out, err = run_cli("plan", "render", solved["engine"], "--out", png)
    assert code == 0, err
    assert out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


# ------------------------------------------------------------------- fleet, model


def test_fleet_show(run_cli: RunCli, fleet_file: Path) -> None:
    code, out, _ = run_cli("fleet", "show", fleet_file)
    assert code == 0
    assert out.startswith("fleet tiny: 2 nodes, 4 GPUs")
    assert "2x A100-SXM4-80GB" in out and "h100-0 900 GB/s" in out and "rack=r1" in out
    code, out, _ = run_cli("fleet", "show", fleet_file, "-o", "json")
    assert code == 0
    assert json.loads(out)["metadata"]["name"] == "tiny"


def test_model_list(run_cli: RunCli) -> None:
    code, out, _ = run_cli("model", "list")
    assert code == 0
    for name in ("deepseek-v3", "qwen3-235b-a22b", "mixtral-8x7b", "llama-3.1-70b"):
        assert name in out
    code, out, _ = run_cli("model", "list", "-o", "yaml")
    rows = yaml.safe_load(out)
    ds = next(r for r in rows if r["name"] == "deepseek-v3")
    assert (ds["layers"], ds["moe_layers"], ds["experts"], ds["top_k"]) == (61, 58, 256, 8)


# ------------------------------------------------------------------- error paths


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _solve(fleet: Path | str, *extra: str | Path) -> list[str | Path]:
    return ["plan", "solve", "--fleet", fleet, "--policy", "greedy", "-q", *extra]


QWEN = ["--model", "qwen3-30b-a3b", "--redundant-experts", "4"]


def test_missing_fleet_file(run_cli: RunCli, tmp_path: Path) -> None:
    code, out, err = run_cli(*_solve(tmp_path / "nope.yaml", *QWEN))
    assert code == 2 and out == ""
    assert_one_error_line(err, "nope.yaml", "does not exist", "To fix")


def test_bad_yaml_names_the_line(run_cli: RunCli, tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.yaml", "spec:\n  nodes:\n  - name: a\n    gpus: [{model: H100\n")
    code, _, err = run_cli("fleet", "show", bad)
    assert code == 2
    assert_one_error_line(err, "bad.yaml", "not valid YAML", "line ")


def test_unknown_gpu_model_names_closest_entries(run_cli: RunCli, tmp_path: Path) -> None:
    fleet = _write(tmp_path / "f.yaml", TINY_FLEET.replace("H100-SXM5-80GB", "H100-SXM6-80GB"))
    code, _, err = run_cli(*_solve(fleet, *QWEN))
    assert code == 2
    assert_one_error_line(
        err, "f.yaml", "spec.nodes[1].gpus[0].model", "H100-SXM6-80GB", "H100-SXM5-80GB"
    )


def test_unknown_preset(run_cli: RunCli, fleet_file: Path) -> None:
    code, _, err = run_cli(*_solve(fleet_file, "--model", "gpt-5"))
    assert code == 2
    assert_one_error_line(err, "unknown model preset 'gpt-5'", "deepseek-v3", "--model-config")


@pytest.mark.parametrize("spec", ["synthetic:zipf:abc", "synthetic:pareto:1.0", "synthetic:zipf:9"])
def test_bad_synthetic_load_spec(run_cli: RunCli, fleet_file: Path, spec: str) -> None:
    code, _, err = run_cli(*_solve(fleet_file, *QWEN, "--load", spec))
    assert code == 2
    assert_one_error_line(err, "load")


def test_missing_load_file(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    code, _, err = run_cli(*_solve(fleet_file, *QWEN, "--load", tmp_path / "load.json"))
    assert code == 2
    assert_one_error_line(err, "load file", "does not exist")


def test_nan_in_load_file(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    rows = [[1.0] * 128 for _ in range(48)]
    text = json.dumps(rows).replace("1.0", "NaN", 1)
    load = _write(tmp_path / "load.json", text)
    code, _, err = run_cli(*_solve(fleet_file, *QWEN, "--load", load))
    assert code == 2
    assert_one_error_line(err, "load.json", "NaN", "finite")


def test_infinity_in_yaml_load_file(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    rows = [[1.0] * 128 for _ in range(48)]
    rows[3][7] = math.inf
    load = _write(tmp_path / "load.yaml", yaml.safe_dump(rows))
    code, _, err = run_cli(*_solve(fleet_file, *QWEN, "--load", load))
    assert code == 2
    assert_one_error_line(err, "load.yaml", "[3][7]", "finite")


def test_wrong_load_shape(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    load = _write(tmp_path / "load.json", json.dumps([[1.0] * 128 for _ in range(7)]))
    code, _, err = run_cli(*_solve(fleet_file, *QWEN, "--load", load))
    assert code == 2
    assert_one_error_line(err, "load.json", "has 7 layers", "48 MoE layers")
    load = _write(tmp_path / "load.json", json.dumps([[1.0] * 100 for _ in range(48)]))
    code, _, err = run_cli(*_solve(fleet_file, *QWEN, "--load", load))
    assert code == 2
    assert_one_error_line(err, "row 0 has 100 experts")


def test_sglang_dump_load_file_is_accepted(
    run_cli: RunCli, fleet_file: Path, tmp_path: Path
) -> None:
    steps = [[[float(e % 5 + 1) for e in range(128)] for _ in range(48)] for _ in range(3)]
    load = _write(tmp_path / "dump.json", json.dumps({"logical_count": steps}))
    code, out, _ = run_cli(*_solve(fleet_file, *QWEN, "--load", load, "-o", "json"))
    assert code == 0
    assert json.loads(out)["workload"]["load_source"] == f"file:{load}"


def test_engine_form_with_indivisible_slots(run_cli: RunCli, fleet_file: Path) -> None:
    code, _, err = run_cli(
        *_solve(fleet_file, "--model", "qwen3-30b-a3b", "--redundant-experts", "3")
    )
    assert code == 2
    assert_one_error_line(err, "128 + 3", "4 GPUs", "--redundant-experts 0 or 4", "--form native")


def test_native_export_refused(run_cli: RunCli, solved: dict[str, Path]) -> None:
    code, out, err = run_cli("plan", "export", solved["native"], "--format", "sglang")
    assert code == 2 and out == ""
    assert_one_error_line(err, "native form", "--form engine")


@pytest.mark.parametrize(
    "argv",
    [
        ["fleet", "show", "FLEET", "-o", "xml"],
        ["plan", "show", "PLAN", "-o", "csv"],
        ["plan", "export", "PLAN", "--format", "deepspeed"],
        ["plan", "solve", "--fleet", "FLEET", "--model", "mixtral-8x7b", "--tokens", "many"],
        ["plan", "solve", "--fleet", "FLEET", "--model", "x", "--model-config", "y"],
        ["plan", "solve", "--fleet", "FLEET", "--model", "mixtral-8x7b", "--policy", "best"],
        ["plan"],
        [],
    ],
)
def test_usage_errors(run_cli: RunCli, solved: dict[str, Path], argv: list[str]) -> None:
    subst = {"FLEET": str(solved["fleet"]), "PLAN": str(solved["engine"])}
    code, out, err = run_cli(*[subst.get(a, a) for a in argv])
    assert code == 2 and out == ""
    assert_one_error_line(err, "--help")


def test_bad_policies_list(run_cli: RunCli, fleet_file: Path) -> None:
    code, _, err = run_cli(
        "plan", "compare", "--fleet", fleet_file, *QWEN, "--policies", "uniform,magic", "-q"
    )
    assert code == 2
    assert_one_error_line(err, "magic", "uniform, eplb, greedy, ilp")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "not valid JSON"),
        ('{"schema_version": 1}', "missing field 'gpus'"),
        ('{"schema_version": 7}', "schema_version 7"),
        ('{"schema_version": 1, "gpus": [[1, 2]], "id": "x"}', "gpus[0]: missing field"),
        ('{"schema_version": 1, "gpus": [7], "id": "x"}', "malformed"),
        ("[1, 2]", "JSON object"),
        ("   ", "empty"),
    ],
)
def test_bad_plan_files(run_cli: RunCli, tmp_path: Path, text: str, needle: str) -> None:
    plan = _write(tmp_path / "plan.json", text)
    code, _, err = run_cli("plan", "show", plan)
    assert code == 2
    assert_one_error_line(err, "plan.json", needle)


def test_bad_model_config(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    cfg = _write(tmp_path / "config.json", json.dumps({"model_type": "bert"}))
    code, _, err = run_cli(*_solve(fleet_file, "--model-config", cfg))
    assert code == 2
    assert_one_error_line(err, "config.json", "unsupported model_type 'bert'")


def test_model_config_is_read(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    cfg_dir = tmp_path / "Mini-MoE"
    cfg_dir.mkdir()
    cfg = {
        "model_type": "mixtral",
        "num_hidden_layers": 4,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 2048,
        "vocab_size": 32000,
    }
    path = _write(cfg_dir / "config.json", json.dumps(cfg))
    code, out, _ = run_cli(
        *_solve(fleet_file, "--model-config", path, "--redundant-experts", "4", "-o", "json")
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["model"] == "Mini-MoE" and len(doc["moe_layers"]) == 4


def test_unwritable_out(run_cli: RunCli, fleet_file: Path, tmp_path: Path) -> None:
    blocker = _write(tmp_path / "file", "x")
    code, _, err = run_cli(*_solve(fleet_file, *QWEN, "--out", blocker / "plan.json"))
    assert code == 2
    assert_one_error_line(err, "cannot write plan", "--out")


def test_infeasible_exits_3_with_reasons(run_cli: RunCli, tmp_path: Path) -> None:
    small = _write(
        tmp_path / "l4.yaml",
        "metadata: {name: small}\nspec:\n  nodes:\n  - name: n\n    gpus: [{model: L4, count: 2}]\n",
    )
    code, out, err = run_cli(*_solve(small, "--model", "deepseek-v3", "--redundant-experts", "0"))
    assert code == 3 and out == ""
    assert "Traceback" not in err
    assert err.startswith("error: infeasible: the fleet's free memory is too small")
    assert "\n  - need " in err and "To fix" in err


def test_help_exits_0(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "solve", "--help")
    assert code == 0
    assert "--redundant-experts" in out and "--time-limit" in out


def test_command_modules_are_one_line_each() -> None:
    parser = cli.build_parser()
    text = parser.format_help()
    for group in ("fleet", "model", "plan", "advise"):
        assert group in text
    assert "bench" not in text and "operator" not in text


# ------------------------------------------------------------------- subprocess


def test_console_entry_point_in_a_subprocess(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "controlplane.cli", "fleet", "show", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert_one_error_line(proc.stderr, "missing.yaml", "does not exist")
