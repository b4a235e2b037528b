"""What every ``mixfleetctl`` command group shares: parser builders and output.

* Parsers: :func:`add_group` adds a command group, :func:`add_leaf` a leaf command that sets
  ``handler`` (``args -> exit status``), :func:`add_output_arg` the ``-o table|json|yaml``
  option.
* Output: results go to stdout through :func:`emit` (tables from :func:`format_table` or
  :func:`table`, documents from :func:`controlplane.cli.files.dump_document` or
  :func:`print_json`); progress and hints go to stderr through a :data:`Note` from
  :func:`notes` (silent with ``--quiet``).

Errors are not printed here: handlers raise :class:`policies.errors.MixfleetError`
subclasses, worded "what went wrong. To fix: ...", and :func:`controlplane.cli.main` prints
them as one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

#: Output formats of the local commands (``-o``); the controller's clients offer table|json.
OUTPUTS = ("table", "json", "yaml")

Handler = Callable[[argparse.Namespace], int]
Note = Callable[[str], None]


class Groups(Protocol):
    """What ``ArgumentParser.add_subparsers()`` returns, as far as the commands use it."""

    def add_parser(
        self, name: str, *, help: str | None = ..., description: str | None = ...
    ) -> argparse.ArgumentParser:
        """Add the sub-command ``name``; returns its parser."""
        ...


# ------------------------------------------------------------------------- parsers


def add_group(groups: Groups, name: str, help_text: str, *, required: bool = True) -> Groups:
    """Add command group ``name``; returns the action its leaf commands are added to.

    ``required=False`` lets the bare group through with no ``handler``, which
    :func:`controlplane.cli.main` answers with the help text and exit status 2.
    """
    p = groups.add_parser(name, help=help_text, description=help_text)
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION", required=required)


def add_leaf(
    group: Groups,
    name: str,
    handler: Handler,
    help_text: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Add leaf command ``name`` to ``group``, run by ``handler``."""
    p = group.add_parser(name, help=help_text, description=description or help_text)
    p.set_defaults(handler=handler)
    return p


def add_output_arg(p: argparse.ArgumentParser) -> None:
    """``-o/--output table|json|yaml`` (default: table)."""
    p.add_argument(
        "-o", "--output", choices=OUTPUTS, default="table", help="stdout format (default: table)"
    )


# ------------------------------------------------------------------------- stdout


def emit(text: str) -> None:
    """Write a result to stdout, ending in one newline."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def print_json(doc: Any) -> None:
    """Write ``doc`` to stdout as indented JSON."""
    print(json.dumps(doc, indent=2, sort_keys=False))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: columns padded to their widest cell, numbers right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def numeric(cell: str) -> bool:
        stripped = cell.replace(",", "").replace("%", "").replace("x", "").strip()
        try:
            float(stripped)
        except ValueError:
            return False
        return True

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if numeric(c) else c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows as left-aligned columns, no rule under the headers (the controller's clients)."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def fmt_opt(value: float | None, fmt: str, none: str = "-") -> str:
    """``value`` formatted with ``fmt``, or ``none`` when there is no value."""
    return none if value is None else format(value, fmt)


def gpu_groups(models: Sequence[str]) -> str:
    """``8x A100-SXM4-80GB + 8x H100-SXM5-80GB`` (consecutive runs)."""
    runs: list[list[Any]] = []
    for m in models:
        if runs and runs[-1][1] == m:
            runs[-1][0] += 1
        else:
            runs.append([1, m])
    return " + ".join(f"{n}x {m}" for n, m in runs)


# ------------------------------------------------------------------------- stderr


def stderr_note(message: str) -> None:
    """Print one progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def quiet_note(message: str) -> None:
    """Discard a progress line."""


def notes(args: argparse.Namespace) -> Note:
    """Where progress and hints go: stderr, or nowhere with ``--quiet``."""
    return quiet_note if getattr(args, "quiet", False) else stderr_note


@contextmanager
def ticker(note: Note, label: str, interval_s: float = 15.0) -> Iterator[None]:
    """Report ``label: N s elapsed`` every ``interval_s`` seconds while the body runs."""
    stop = threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        while not stop.wait(interval_s):
            note(f"  ... {label}: {time.monotonic() - t0:.0f} s elapsed")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
