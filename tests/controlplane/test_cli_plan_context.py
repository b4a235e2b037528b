"""``plan diff`` and ``plan solve --previous`` check that the two plans answer the same
question: plans of another fleet or model are refused (their GPUs or experts are not the
same ones), a different workload or engine is named in a warning. Real greedy solves on
small fleet files."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_builders import MIXTRAL_ARGS, TINY_FLEET, RunCli, cli_runner, write_fleet


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> RunCli:
    return cli_runner(capsys)


def _options(context: str) -> list[str]:
    out = list(MIXTRAL_ARGS)
    out[out.index("--context") + 1] = context
    return out


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Greedy Mixtral plans: on fleet ``tiny`` at context 2048 and 4096, and on a copy of
    that fleet named ``other``."""
    from controlplane.cli import main

    d = tmp_path_factory.mktemp("plans")
    tiny = write_fleet(d)
    other_dir = d / "other"
    other_dir.mkdir()
    other = write_fleet(other_dir, TINY_FLEET.replace("name: tiny", "name: other"))
    out = {"tiny": tiny, "other_fleet": other}
    for name, fleet, context in (
        ("base", tiny, "2048"),
        ("long", tiny, "4096"),
        ("other", other, "2048"),
    ):
        path = d / f"{name}.json"
        argv = ["plan", "solve", "--fleet", str(fleet), *_options(context), "--policy", "greedy"]
        assert main([*argv, "--out", str(path)]) == 0
        out[name] = path
    return out


def test_diff_refuses_plans_of_two_fleets(run_cli: RunCli, plans: dict[str, Path]) -> None:
    code, out, err = run_cli("plan", "diff", plans["base"], plans["other"])
    assert code == 2 and out == ""
    assert err.startswith(
        "error: B: plans A and B answer different questions (fleet tiny -> other)"
    )
    assert err.count("\n") == 1


def test_diff_warns_of_another_workload(run_cli: RunCli, plans: dict[str, Path]) -> None:
    code, out, err = run_cli("plan", "diff", plans["base"], plans["long"])
    assert code == 0, err
    assert err == "warning: plans A and B differ in context_len 2048 -> 4096\n"
    assert out  # the diff itself


def test_previous_of_another_fleet_is_refused(run_cli: RunCli, plans: dict[str, Path]) -> None:
    argv = ["plan", "solve", "--fleet", plans["tiny"], *_options("2048"), "--policy", "greedy"]
    code, out, err = run_cli(*argv, "--previous", plans["other"])
    assert code == 2 and out == ""
    assert err.startswith("error: --previous: the --previous plan and this solve answer")
    assert "fleet other -> tiny" in err


def test_previous_of_another_context_solves_with_a_warning(
    run_cli: RunCli, plans: dict[str, Path], tmp_path: Path
) -> None:
    argv = ["plan", "solve", "--fleet", plans["tiny"], *_options("4096"), "--policy", "greedy"]
    argv = [a for a in argv if a != "-q"]  # the warning is a note: not with --quiet
    code, _, err = run_cli(*argv, "--previous", plans["base"], "--out", tmp_path / "p.json")
    assert code == 0, err
    assert "warning: the --previous plan and this solve differ in context_len 2048 -> 4096" in err


def test_previous_of_the_same_question_says_nothing(
    run_cli: RunCli, plans: dict[str, Path], tmp_path: Path
) -> None:
    argv = ["plan", "solve", "--fleet", plans["tiny"], *_options("2048"), "--policy", "greedy"]
    argv = [a for a in argv if a != "-q"]
    code, _, err = run_cli(*argv, "--previous", plans["base"], "--out", tmp_path / "p.json")
    assert code == 0, err
    assert "warning" not in err
