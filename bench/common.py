"""What the benchmark runners share: their command line and the record of a run.

Every runner (``python -m bench.placement``, ``python -m bench.strategies``) takes
``--scenario NAME|all``, ``--json``, ``--out PATH`` and ``--docs PATH`` (:func:`add_arguments`),
records the command that reproduces it (:func:`command_line`) and the machine it ran on
(:func:`package_versions`), and reports a bad command line as one ``error:`` line with exit
status 2 (:func:`run_main`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from policies.errors import InputError

EXIT_USAGE = 2


def add_arguments(p: argparse.ArgumentParser, *, docs_help: str = "Markdown page to write") -> None:
    """``--scenario``, ``--json``, ``--out``, ``--docs``."""
    p.add_argument("--scenario", default="all", metavar="NAME|all", help="default: all")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--out", metavar="PATH", help="results JSON file")
    p.add_argument("--docs", metavar="PATH", help=docs_help)


def command_line(module: str, args: argparse.Namespace, *, with_json: bool) -> str:
    """The ``python -m MODULE ...`` line that reproduces a run of ``args``."""
    argv = ["python", "-m", module, "--scenario", str(getattr(args, "scenario", "all") or "all")]
    if with_json and getattr(args, "json", False):
        argv.append("--json")
    if getattr(args, "out", None):
        argv += ["--out", str(args.out)]
    if getattr(args, "docs", None):
        argv += ["--docs", str(args.docs)]
    return " ".join(argv)


def package_versions(names: Sequence[str]) -> dict[str, str]:
    """Installed version of each package, ``missing`` when it is not installed."""
    versions = {}
    for pkg in names:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "missing"
    return versions


def write_results(doc: Mapping[str, Any], args: argparse.Namespace) -> None:
    """``doc`` as indented JSON: to the ``--out`` file when given, and on stdout with
    ``--json`` or without ``--out``."""
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json or not args.out:
        print(text)


def log(msg: str) -> None:
    """One progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def run_main(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv`` with ``parser`` and run; a bad input is one ``error:`` line, exit 2."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
