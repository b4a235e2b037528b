"""``python -m bench.router --peers --pin``: CPUs per role parsed, and a bad list refused with
one ``error:`` line (exit 2) before anything starts."""

from __future__ import annotations

import pytest

from bench.router import main
from bench.router_peers import parse_pin
from policies.errors import InputError


def test_roles_and_ranges() -> None:
    assert parse_pin("router=0-1;engines=2,3;client=4-6,9") == {
        "router": frozenset({0, 1}),
        "engines": frozenset({2, 3}),
        "client": frozenset({4, 5, 6, 9}),
    }
    assert parse_pin("") == {}


@pytest.mark.parametrize("bad", ["gpu=0", "router=a", "router=1-b", "router="])
def test_bad_lists_are_refused(bad: str) -> None:
    with pytest.raises(InputError, match="--pin"):
        parse_pin(bad)


def test_the_cli_says_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--peers", "--pin", "router=x", "--out", "unused.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --pin router: 'x' is not a CPU list like 0-1,4"]
