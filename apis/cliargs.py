"""Command-line conventions shared by ``mixfleetctl``, ``mixfleet-router``,
``mixfleet-agent`` and ``mixfleet-operator``: one parser class and the argument types of
numbers that must be positive.

* :class:`StrictParser`: no prefix matching of long options (``--out`` is not taken as
  ``--output``, ``--polic`` is refused), and every option's default shown in ``--help``
  (:class:`DefaultsHelpFormatter`). Sub-parsers inherit the class, so one parser built from
  it is strict all the way down.
* :func:`positive_float`, :func:`positive_int`, :func:`non_negative_float`,
  :func:`non_negative_int`: argparse types that refuse a value at parse time; argparse then
  names the flag (``argument --time-limit: must be > 0, got 0``).

Only the standard library is imported: every command's parser is built from this module and
``--help`` must stay cheap.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Sequence
from typing import Any


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already speaks of its
    default, or the option has none worth showing (``None``, ``False``, an empty list,
    ``argparse.SUPPRESS``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if default_worth_showing(action) and "default" not in text.lower():
            text = f"{text} (default: %(default)s)".strip()
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not (action.help and action.help.strip()) and default_worth_showing(action):
            action = copy.copy(action)  # an option without help still shows its default
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class RawDescriptionDefaultsHelpFormatter(
    DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter
):
    """:class:`DefaultsHelpFormatter` that keeps the description's line breaks."""


def default_worth_showing(action: argparse.Action) -> bool:
    """Whether ``--help`` should show ``action``'s default: an option (or optional
    positional) whose default is a value a user could type."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or default is False:
        return False
    if isinstance(default, list | tuple | dict | set) and not default:
        return False
    if action.help is argparse.SUPPRESS or isinstance(action, argparse._VersionAction):
        return False
    return bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, "*")


class StrictParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without prefix matching (``allow_abbrev=False``) and
    with :class:`DefaultsHelpFormatter`, unless a caller passes other values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def _number(text: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, rates, fractions)."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return float(value)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (counts, ports, limits)."""
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return int(value)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (where 0 has a documented meaning)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return float(value)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (where 0 has a documented meaning)."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return int(value)


def program_version(program: str) -> str:
    """``PROGRAM X.Y.Z``: the installed ``mixfleet`` distribution's version, read from its
    metadata only when asked (the import costs a few milliseconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{program} {version('mixfleet')}"
    except PackageNotFoundError:  # run from a tree that is not installed
        return f"{program} (not installed: version unknown)"


class VersionAction(argparse.Action):
    """``--version``: print :func:`program_version` of ``program`` and exit 0."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, program: str = "", **kwargs: Any
    ) -> None:
        kwargs.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.program = program

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(program_version(self.program or parser.prog.split()[0]))
        parser.exit(0)


def add_version_arg(parser: argparse.ArgumentParser, program: str) -> None:
    """``--version`` on ``parser``, printing ``program X.Y.Z``."""
    parser.add_argument("--version", action=VersionAction, program=program)
