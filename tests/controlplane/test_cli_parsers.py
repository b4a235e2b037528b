"""Every command line of the project parses the same way: no prefix matching of long
options (every parser and sub-parser, and every ``ArgumentParser(...)`` written in the
source), every default shown in ``--help``, positive numbers refused at parse time naming
the flag, ``--version`` on every console script."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.cli import build_parser as agent_parser
from agents.cli import main as agent_main
from apis.cliargs import DefaultsHelpFormatter, default_worth_showing
from controlplane.cli import build_parser as ctl_parser
from controlplane.cli import main as ctl_main
from controlplane.cli.router import main as router_main
from operators.cli import build_parser as operator_parser

REPO = Path(__file__).resolve().parents[2]
#: Folders whose Python files may build a command line.
SOURCE_DIRS = (
    "apis",
    "agents",
    "bench",
    "controlplane",
    "examples",
    "operators",
    "policies",
    "proto",
)


def _parsers(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every sub-parser below it, with its command path."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    return [
        *_parsers(ctl_parser(), "mixfleetctl"),
        *_parsers(agent_parser(), "mixfleet-agent"),
        *_parsers(operator_parser(), "mixfleet-operator"),
    ]


def test_no_parser_or_sub_parser_matches_prefixes() -> None:
    parsers = _every_parser()
    assert len(parsers) > 60  # every group and command of the three programs
    loose = [path for path, p in parsers if p.allow_abbrev]
    assert loose == []


def _argument_parser_calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "ArgumentParser":
                yield node


def test_every_argument_parser_in_the_source_refuses_prefixes() -> None:
    """Benchmarks, module entry points and the demo build their own parsers: each call
    passes ``allow_abbrev=False`` (the three programs use :class:`StrictParser`)."""
    found, loose = 0, []
    for folder in SOURCE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(REPO).parts):
                continue  # virtual environments of the benchmarks
            for call in _argument_parser_calls(ast.parse(path.read_text(), str(path))):
                found += 1
                kw = {k.arg: k.value for k in call.keywords}
                value = kw.get("allow_abbrev")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    loose.append(f"{path.relative_to(REPO)}:{call.lineno}")
    assert found >= 15
    assert loose == []


@pytest.mark.parametrize(
    "argv",
    [
        ["gpu", "list", "--out", "table"],  # --out is not --output
        ["plan", "solve", "--fleet", "f.yaml", "--model", "mixtral-8x7b", "--polic", "ilp"],
        ["plans", "history", "x", "--lim", "3"],
    ],
)
def test_a_prefix_of_an_option_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --") and err.count("\n") == 1


def test_agent_refuses_a_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--fleet", "f.yaml", "--controller", "127.0.0.1:1", "--insec"]
    assert agent_main(argv) == 2
    assert "unrecognized arguments: --insec" in capsys.readouterr().err


def test_every_default_is_shown_in_help() -> None:
    missing = []
    for path, parser in _every_parser():
        formatter = parser._get_formatter()
        assert isinstance(formatter, DefaultsHelpFormatter), path
        for action in parser._actions:
            if default_worth_showing(action):
                text = formatter._format_action(action)
                if "default" not in text:
                    missing.append(f"{path} {action.option_strings or action.dest}")
    assert missing == []


def test_help_names_a_default_that_had_no_help_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl_main(["plans", "list", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--limit LIMIT (default: 50)" in text


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (
            ["plan", "solve", "--fleet", "f", "--model", "m", "--time-limit", "0"],
            "--time-limit",
            "0",
        ),
        (["plan", "solve", "--fleet", "f", "--model", "m", "--workers", "-1"], "--workers", "-1"),
        (
            ["plan", "solve", "--fleet", "f", "--model", "m", "--mip-gap", "-0.1"],
            "--mip-gap",
            "-0.1",
        ),
        (["plans", "history", "x", "--limit", "0"], "--limit", "0"),
        (["router", "status", "--timeout", "0"], "--timeout", "0"),
        (["router", "run", "--queue-limit", "0"], "--queue-limit", "0"),
        (["watch", "--timeout", "nan"], "--timeout", "nan"),
    ],
)
def test_a_number_out_of_range_is_refused_at_parse_time_naming_the_flag(
    argv: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument {flag}") and value in err, err
    assert err.count("\n") == 1


def test_agent_refuses_a_zero_heartbeat_interval(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--fleet", "f.yaml", "--controller", "h:1", "--max-backoff", "0"]
    assert agent_main(argv) == 2
    assert capsys.readouterr().err.startswith("error: argument --max-backoff: must be > 0")


def _version(script: str, code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, "--version"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


@pytest.mark.parametrize(
    ("script", "code"),
    [
        ("mixfleetctl", "import sys; from controlplane.cli import main; sys.exit(main())"),
        ("mixfleet-agent", "import sys; from agents.cli import main; sys.exit(main())"),
        (
            "mixfleet-router",
            "import sys; from controlplane.cli.router import main; sys.exit(main())",
        ),
        ("mixfleet-operator", "import sys; from operators.cli import main; sys.exit(main())"),
    ],
)
def test_every_console_script_prints_its_version(script: str, code: str) -> None:
    out = _version(script, code)
    name, _, number = out.strip().partition(" ")
    assert name == script and number and out.count("\n") == 1, out


def test_router_version_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert router_main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("mixfleet-router ")


#: What ``mixfleetctl --version`` may import of the project: the dispatcher, the parser
#: conventions and the error types (no command module, no solver, no gRPC, no YAML).
VERSION_MODULES = {"apis", "apis.cliargs", "controlplane", "controlplane.cli", "policies"}
VERSION_MODULES |= {"policies.errors"}


def test_version_imports_only_what_it_needs() -> None:
    code = (
        "import json, sys; before = set(sys.modules); sys.argv = ['mixfleetctl', '--version']\n"
        "from controlplane.cli import main\n"
        "status = main()\n"
        "print(json.dumps(sorted(set(sys.modules) - before)), file=sys.stderr)\n"
        "sys.exit(status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("mixfleetctl ")
    loaded = set(json.loads(done.stderr))
    project = {m for m in loaded if m.split(".")[0] in {*SOURCE_DIRS, "mixfleet"}}
    assert project == VERSION_MODULES
    heavy = {"grpc", "yaml", "numpy", "pulp", "highspy", "google.protobuf", "structlog"}
    assert loaded.isdisjoint(heavy)
