"""``mixfleetctl`` habits: one default per concept, ``-o`` everywhere, documents that
round-trip, ``--version``, completion, the client config, offline inspection, and a cheap
import. The remote habits (watch reconnect, TLS mismatch, fleet export, deploy round trip)
are in ``test_cli_habits_remote.py``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_builders import MIXTRAL_ARGS, RunCli, cli_runner, solve_plans, write_fleet

from controlplane.cli import build_parser, clientconfig
from controlplane.cli.files import read_fleet, read_plan
from controlplane.cli.habits import completion_script
from policies import defaults
from policies.errors import InputError


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


@pytest.fixture(scope="module")
def solved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return solve_plans(tmp_path_factory.mktemp("plans"))


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = []
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    for action in subs:
        for name, sub in action.choices.items():
            out += _leaves(sub, (*path, name))
    return out


def _option(p: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in p._actions if flag in a.option_strings), None)


# ------------------------------------------------------------------------ -o, defaults

#: Commands without -o: long-running servers and a script generator.
NO_OUTPUT = {("controller", "run"), ("router", "run"), ("completion",)}


def test_every_command_accepts_o_yaml_and_name() -> None:
    leaves = _leaves(build_parser())
    assert len(leaves) > 30
    for path, p in leaves:
        if path in NO_OUTPUT:
            continue
        o = _option(p, "-o")
        assert o is not None, path
        assert set(o.choices or ()) >= {"table", "json", "yaml", "name"}, path


def _default(path: tuple[str, ...], flag: str) -> object:
    p = dict(_leaves(build_parser()))[path]
    action = _option(p, flag)
    assert action is not None, (path, flag)
    return action.default


PLACEMENT = [("plan", "solve"), ("plan", "compare"), ("plan", "cost"), ("plan", "min-cost")]
ADVICE = [("advise", "batch"), ("advise", "context"), ("advise", "tiers")]


@pytest.mark.parametrize("path", PLACEMENT + ADVICE)
def test_parser_defaults_are_policies_defaults(path: tuple[str, ...]) -> None:
    assert _default(path, "--phase") == defaults.DEFAULT_PHASE
    assert _default(path, "--context") == defaults.DEFAULT_CONTEXT_LEN
    assert _default(path, "--kv-cache-dtype") == defaults.DEFAULT_KV_CACHE_DTYPE
    assert _default(path, "--form") == defaults.DEFAULT_FORM
    assert _default(path, "--redundant-experts") is None  # auto
    assert _default(path, "--time-limit") == defaults.DEFAULT_SOLVER_TIME_LIMIT_S
    assert _default(path, "--mip-gap") == defaults.DEFAULT_MIP_GAP
    assert _default(path, "--solver") == defaults.DEFAULT_MILP_SOLVER
    assert _default(path, "--workers") == defaults.DEFAULT_WORKERS
    policy = _default(path, "--policy") if path != ("plan", "compare") else None
    sweep = path in (("advise", "batch"), ("advise", "context"))
    if policy is not None:
        assert policy == (defaults.DEFAULT_SWEEP_POLICY if sweep else defaults.DEFAULT_POLICY)


def test_deployment_crd_and_request_defaults_are_policies_defaults() -> None:
    from apis.kube import v1alpha1
    from policies.request import SolverOptions
    from policies.spec.build import parse_deployment
    from policies.spec.types import DeploymentSpec, WorkloadSpec

    w, d = WorkloadSpec(), DeploymentSpec(name="x")
    assert w.tokens_per_gpu == defaults.DEFAULT_TOKENS_PER_GPU["decode"]
    assert (w.phase, w.context_len, w.kv_cache_dtype) == (
        defaults.DEFAULT_PHASE,
        defaults.DEFAULT_CONTEXT_LEN,
        defaults.DEFAULT_KV_CACHE_DTYPE,
    )
    assert (d.policy, d.form, d.redundant_experts) == (
        defaults.DEFAULT_POLICY,
        defaults.DEFAULT_FORM,
        None,
    )
    assert d.solver_time_limit_s == defaults.DEFAULT_SOLVER_TIME_LIMIT_S
    crd = v1alpha1.WorkloadSpec()
    # the CRD leaves tokensPerGpu unset (its default depends on the phase; the operator
    # resolves it: tests/operators/test_operator_strict_inputs.py)
    assert (crd.tokens_per_gpu, crd.context_len) == (None, w.context_len)
    assert v1alpha1.PlacementPolicySpec().policy == defaults.DEFAULT_POLICY
    assert SolverOptions().time_limit_s == defaults.DEFAULT_SOLVER_TIME_LIMIT_S
    # a prefill deployment without tokensPerGpu takes the prefill default, as the CLI does
    spec = {"model": "mixtral-8x7b", "workload": {"phase": "prefill"}}
    doc = {"metadata": {"name": "p"}, "spec": spec}
    assert (
        parse_deployment(doc).workload.tokens_per_gpu == defaults.DEFAULT_TOKENS_PER_GPU["prefill"]
    )


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "solve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: auto" in text and "default: ilp" in text and "64 decode, 4096 prefill" in text


@pytest.mark.parametrize(
    ("experts", "gpus", "form", "want"),
    [(128, 24, "engine", 16), (256, 16, "engine", 0), (8, 3, "engine", 1), (128, 24, "native", 0)],
)
def test_auto_redundant_experts_is_valid(experts: int, gpus: int, form: str, want: int) -> None:
    r = defaults.auto_redundant_experts(experts, gpus, form)
    assert r == want
    if form == "engine":
        assert (experts + r) % gpus == 0


def test_auto_redundant_experts_on_24_gpus_solves_and_says_so(
    run_cli: RunCli, tmp_path: Path
) -> None:
    fleet = Path(__file__).resolve().parents[2] / "examples" / "fleets" / "mixed-24.yaml"
    out = tmp_path / "p.json"
    code, stdout, err = run_cli(
        "plan", "solve", "--fleet", fleet, "--model", "qwen3-30b-a3b", "--policy", "greedy",
        "--out", out,
    )  # fmt: skip
    assert code == 0, err
    assert "redundant experts: auto -> 16" in err
    assert read_plan(out).num_redundant == 16
    # --out: a one-line summary on stdout, not the whole plan
    assert len(stdout.splitlines()) == 2 and "16 redundant slots" in stdout


def test_context_accepts_k(run_cli: RunCli, tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path)
    args = list(MIXTRAL_ARGS)
    args[args.index("--context") + 1] = "2k"
    code, out, err = run_cli("plan", "solve", "--fleet", fleet, *args, "--policy", "greedy",
                             "-o", "json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["workload"]["context_len"] == 2048
    code, _, err = run_cli("plan", "solve", "--fleet", fleet, *args, "--context", "lots")
    assert code == 2 and "--context" in err and "32k" in err
    code, _, err = run_cli("plan", "solve", "--fleet", fleet, *args, "--redundant-experts", "x")
    assert code == 2 and "--redundant-experts" in err and "auto" in err


# ------------------------------------------------------------------------ round trips


def test_fleet_show_yaml_keeps_groups_and_round_trips(run_cli: RunCli, tmp_path: Path) -> None:
    fleet = Path(__file__).resolve().parents[2] / "examples" / "fleets" / "mixed-24.yaml"
    code, out, _ = run_cli("fleet", "show", fleet, "-o", "yaml")
    assert code == 0
    doc = yaml.safe_load(out)
    assert [g["count"] for n in doc["spec"]["nodes"] for g in n["gpus"]] == [8, 8, 8]
    again = tmp_path / "again.yaml"
    again.write_text(out)
    assert read_fleet(again) == read_fleet(fleet)
    code, out, _ = run_cli("fleet", "show", fleet, "-o", "name")
    assert out == "fleet/mixed-24\n"


def test_model_list_name(run_cli: RunCli) -> None:
    code, out, _ = run_cli("model", "list", "-o", "name")
    assert code == 0 and "model/deepseek-v3" in out.splitlines()


# ------------------------------------------------------------------------ inspection


def test_plan_diff(run_cli: RunCli, solved: dict[str, Path]) -> None:
    code, out, err = run_cli("plan", "diff", solved["engine"], solved["engine"])
    assert code == 0 and "no differences" in out, err
    code, out, _ = run_cli("plan", "diff", solved["engine"], solved["native"], "-o", "json")
    assert code == 0
    d = json.loads(out)
    a, b = read_plan(solved["engine"]), read_plan(solved["native"])
    assert d["summary"]["policy"] == {"from": "ilp", "to": "greedy"}
    held = {g.gpu: [{s.expert for s in layer} for layer in g.experts] for g in a.gpus}
    moves = sum(
        len({s.expert for s in layer} - held[g.gpu][i])
        for g in b.gpus
        for i, layer in enumerate(g.experts)
    )
    assert d["expert_moves"] == moves > 0
    code, _, _ = run_cli("plan", "diff", solved["engine"], solved["native"], "--exit-code")
    assert code == 1


def test_plan_compare_saved_plans_with_cost(run_cli: RunCli, solved: dict[str, Path]) -> None:
    code, out, err = run_cli("plan", "compare", solved["engine"], solved["native"])
    assert code == 0, err
    assert "USD/Mtok" in out.splitlines()[0]
    code, out, _ = run_cli("plan", "compare", solved["engine"], solved["native"], "-o", "json")
    rows = json.loads(out)["plans"]
    assert [r["policy"] for r in rows] == ["ilp", "greedy"]
    from policies.advice.cost import PriceTable, plan_cost

    want = plan_cost(read_plan(solved["engine"]), PriceTable()).usd_per_million_tokens
    assert rows[0]["usd_per_million_tokens"] == pytest.approx(want)
    code, _, err = run_cli("plan", "compare")
    assert code == 2 and "--fleet" in err


def test_plan_solve_exclude_nodes(run_cli: RunCli, tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path)
    argv = ["plan", "solve", "--fleet", fleet, *MIXTRAL_ARGS, "--policy", "greedy", "-o", "json"]
    argv[argv.index("--redundant-experts") + 1] = "0"
    code, out, err = run_cli(*argv, "--exclude-nodes", "a100-0")
    assert code == 0, err
    assert {g["node"] for g in json.loads(out)["gpus"]} == {"h100-0"}
    code, _, err = run_cli(*argv, "--exclude-nodes", "a100-9")
    assert code == 2 and "--exclude-nodes" in err and "a100-0, h100-0" in err


# ------------------------------------------------------------------------ habits


def test_version(run_cli: RunCli) -> None:
    from importlib.metadata import version

    code, out, _ = run_cli("--version")
    assert code == 0 and out.strip() == f"mixfleetctl {version('mixfleet')}"


def _complete(script: str, words: list[str]) -> list[str]:
    """The candidates bash offers for ``words`` (the last one being completed)."""
    line = " ".join(f"'{w}'" for w in words)
    prog = f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _mixfleetctl\n"
    prog += 'printf "%s\\n" "${COMPREPLY[@]}"\n'
    done = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_bash_completion_from_the_parser(run_cli: RunCli) -> None:
    code, script, _ = run_cli("completion", "bash")
    assert code == 0 and script == completion_script(build_parser(), "bash")
    assert _complete(script, ["mixfleetctl", "pl"]) == ["plan", "plans"]
    assert _complete(script, ["mixfleetctl", "plan", "so"]) == ["solve"]
    assert "--exclude-nodes" in _complete(script, ["mixfleetctl", "plan", "solve", "--ex"])
    got = _complete(script, ["mixfleetctl", "plan", "solve", "--policy", ""])
    assert got == list(defaults.POLICIES)
    assert "autoload -U +X bashcompinit" in run_cli("completion", "zsh")[1]


def test_verbose_sets_the_log_level(run_cli: RunCli) -> None:
    import logging

    root = logging.getLogger()
    before = root.level, list(root.handlers)
    try:
        root.handlers.clear()
        assert run_cli("-vv", "model", "list", "-o", "name")[0] == 0
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(before[0])
        root.handlers[:] = before[1]


def test_import_is_cheap() -> None:
    """``import controlplane.cli`` pulls in no solver, network or numeric library."""
    code = (
        "import sys, controlplane.cli; "
        "print([m for m in ('grpc', 'pulp', 'numpy', 'networkx', 'yaml', 'policies.solve', "
        "'policies.advice.cost', 'apis.wire', 'controlplane.server') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------------ client config


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cfg" / "config.yaml"
    monkeypatch.setenv("MIXFLEET_CONFIG", str(path))
    for env in [*clientconfig.ENV.values(), "MIXFLEET_CONTEXT"]:
        monkeypatch.delenv(env, raising=False)
    return path


def _args(**flags: str) -> argparse.Namespace:
    return argparse.Namespace(**{d: flags.get(d) for d in clientconfig.DESTS.values()})


def test_config_contexts(
    run_cli: RunCli, config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert clientconfig.resolve(_args())["controller"] is None  # no file: defaults
    code, out, _ = run_cli("config", "set-context", "prod", "--controller", "ctl:7070",
                           "--tls-ca", "/ca.pem", "--token", "s3cret")  # fmt: skip
    assert code == 0 and "(current)" in out
    run_cli("config", "set-context", "lab", "--controller", "lab:7070")
    assert config_file.stat().st_mode & 0o777 == 0o600
    assert clientconfig.resolve(_args()) == {
        "controller": "ctl:7070",
        "tlsCa": "/ca.pem",
        "tlsCert": None,
        "tlsKey": None,
        "token": "s3cret",
        "tokenFile": None,
    }
    assert run_cli("config", "use-context", "lab")[0] == 0
    assert clientconfig.resolve(_args())["controller"] == "lab:7070"
    monkeypatch.setenv("MIXFLEET_CONTROLLER", "env:1")  # env over the context
    assert clientconfig.resolve(_args())["controller"] == "env:1"
    assert clientconfig.resolve(_args(controller="flag:2"))["controller"] == "flag:2"
    monkeypatch.setenv("MIXFLEET_CONTEXT", "prod")
    assert clientconfig.resolve(_args())["tlsCa"] == "/ca.pem"
    code, out, _ = run_cli("config", "view")
    assert "REDACTED" in out and "s3cret" not in out
    code, out, _ = run_cli("config", "view", "-o", "name")
    assert out.split() == ["context/prod", "context/lab"]
    code, _, err = run_cli("config", "use-context", "nope")
    assert code == 2 and "prod, lab" in err


def test_config_rejects_unknown_keys_with_the_path(config_file: Path) -> None:
    config_file.parent.mkdir(parents=True)
    config_file.write_text("contexts:\n- name: a\n  controller: x:1\n  tlsCA: /ca.pem\n")
    with pytest.raises(InputError, match=r"contexts\[0\]\.tlsCA.*did you mean 'tlsCa'"):
        clientconfig.load_config()
    config_file.write_text("currentContext: b\ncontexts: [{name: a}]\n")
    with pytest.raises(InputError, match="currentContext"):
        clientconfig.load_config()
    config_file.write_text("context: []\n")
    with pytest.raises(InputError, match="did you mean 'contexts'"):
        clientconfig.load_config()


def test_progress_only_on_a_terminal_or_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from controlplane.cli.output import show_progress, ticker

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not show_progress(argparse.Namespace())
    assert show_progress(argparse.Namespace(progress=True))
    assert not show_progress(argparse.Namespace(progress=True, quiet=True))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert show_progress(argparse.Namespace())
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    lines: list[str] = []
    done = threading.Event()

    def note(line: str) -> None:
        lines.append(line)
        done.set()

    with ticker(note, "solving", interval_s=0.01):
        assert done.wait(5)
    assert lines[0].startswith("  ... solving: ") and lines[0].endswith(" s elapsed")
    lines.clear()
    with ticker(note, "solving", interval_s=0.01, enabled=False):
        done.clear()
        assert not done.wait(0.1)
    assert lines == []
