"""What every ``mixfleetctl`` command group shares: parser builders and output.

* Parsers: :func:`add_group` adds a command group, :func:`add_leaf` a leaf command that sets
  ``handler`` (``args -> exit status``), :func:`add_output_arg` the ``-o table|json|yaml|name``
  option every command has, :func:`token_count` the ``32k`` argument type.
* Output: results go to stdout through :func:`emit` (tables from :func:`format_table`, the
  one table style; documents through :func:`emit_document`, which also writes ``-o name``);
  progress and hints go to stderr through a :data:`Note` from :func:`notes` (silent with
  ``--quiet``), and :func:`ticker` shows elapsed time on stderr when it is a terminal or
  with ``--progress``.

The module imports only the standard library: every command's parser is built from it, and
``mixfleetctl --help`` must stay cheap.

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

#: Output formats of every command (``-o``): ``name`` prints ``kind/name`` per object, as
#: ``kubectl -o name`` does.
OUTPUTS = ("table", "json", "yaml", "name")

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
    """``-o/--output table|json|yaml|name`` (default: table)."""
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="table",
        help="stdout format: table, json, yaml, or name (kind/name per object; default: table)",
    )


def add_progress_arg(p: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` and ``--progress`` of a command that can take more than a few seconds."""
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--progress",
        action="store_true",
        help="show the elapsed time on stderr also when it is not a terminal",
    )


def token_count(text: str) -> int:
    """argparse type of a token count: ``4096``, ``32k`` (k = 1024)."""
    part = text.strip().lower()
    scale = 1024 if part.endswith("k") else 1
    try:
        value = int(part[:-1] if scale > 1 else part) * scale
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive token count (write e.g. 4096 or 32k)"
        )
    return value


# ------------------------------------------------------------------------- stdout


def emit(text: str) -> None:
    """Write a result to stdout, ending in one newline."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def print_json(doc: Any) -> None:
    """Write ``doc`` to stdout as indented JSON."""
    print(json.dumps(doc, indent=2, sort_keys=False))


def emit_document(doc: Any, output: str, names: Sequence[str] = ()) -> None:
    """Write ``doc`` as ``json`` or ``yaml`` (through
    :func:`controlplane.cli.files.dump_document`), or ``names`` one per line for ``name``."""
    if output == "name":
        for name in names:
            emit(name)
        return
    from controlplane.cli.files import dump_document

    emit(dump_document(doc, output))


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
    """:func:`format_table` of cells of any type (the one table style)."""
    return format_table([str(h) for h in headers], [[str(c) for c in r] for r in rows])


def clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters for a table cell: whole, or cut at the last
    word boundary that leaves room for ``...`` (mid-word only when the first word alone is
    longer than the cell)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    room = width - 3
    cut = text.rfind(" ", 0, room + 1)
    head = text[:cut] if cut > 0 else text[:room]
    return head.rstrip(" ,;:(") + "..."


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


def show_progress(args: argparse.Namespace) -> bool:
    """Whether to show elapsed time: ``--progress``, or stderr is a terminal (never with
    ``--quiet``)."""
    if getattr(args, "quiet", False):
        return False
    return bool(getattr(args, "progress", False)) or sys.stderr.isatty()


@contextmanager
def ticker(
    note: Note, label: str, interval_s: float = 5.0, *, enabled: bool = True
) -> Iterator[None]:
    """Show ``label: N s elapsed`` on stderr while the body runs: on a terminal one line
    rewritten every second (erased at the end), else a line every ``interval_s`` seconds
    through ``note``; nothing when not ``enabled`` (see :func:`show_progress`)."""
    if not enabled:
        yield
        return
    stop = threading.Event()
    t0 = time.monotonic()
    tty = sys.stderr.isatty()

    def run() -> None:
        while not stop.wait(1.0 if tty else interval_s):
            line = f"  ... {label}: {time.monotonic() - t0:.0f} s elapsed"
            if tty:
                sys.stderr.write(f"\r{line}\x1b[K")
                sys.stderr.flush()
            else:
                note(line)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
