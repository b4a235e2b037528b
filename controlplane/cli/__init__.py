"""``mixfleetctl``: the command-line front door.

A thin dispatcher. Each command group lives in one module that exposes
``register(subparsers)``, which adds the group's parsers and sets ``handler`` (``args -> exit
status``) on every leaf command; :mod:`.output` holds what the groups share (parser builders,
tables, ``-o`` formats, progress on stderr), :mod:`.problem` the inputs of a placement
question, :mod:`.connection` the controller connection. Adding a group is one line in
:data:`COMMAND_MODULES`.

Exit status: 0 success; 1 an unexpected failure of the solver; 2 bad input or usage (one
``error: ...`` line on stderr, never a traceback); 3 infeasible (the reasons follow the
error line); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from apis.cliargs import StrictParser, program_version
from policies.errors import InfeasibleError, InputError, MixfleetError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
EXIT_INTERRUPTED = 130

#: Command groups, in ``--help`` order: modules of this package, each with
#: ``register(groups)``. One line per module; imported when the parser is built, so that
#: ``mixfleetctl --version`` imports none of them.
COMMAND_MODULES: tuple[str, ...] = (
    "fleet",
    "gpu",
    "model",
    "plan",
    "advise",
    "controller",
    "certs",
    "nodes",
    "deploy",
    "plans",
    "store",
    "watch",
    "clientconfig",
    "habits",
    "router",
    "schedule",
    "serve",
)


class _UsageError(Exception):
    """argparse found a bad command line; the message is already worded for the user."""


class _Parser(StrictParser):
    """A :class:`apis.cliargs.StrictParser` (no prefix matching, defaults in ``--help``) that reports usage errors as one ``error:`` line and lets
    :func:`main` return the exit status instead of calling ``sys.exit`` itself."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message}. To fix: see '{self.prog} --help'")


def build_parser() -> argparse.ArgumentParser:
    """The full ``mixfleetctl`` parser, from :data:`COMMAND_MODULES`."""
    parser = _Parser(
        prog="mixfleetctl",
        description="Placement control plane for LLM inference on mixed GPU fleets.",
    )
    # Sub-parsers are _Parser too (argparse uses the parent's class); register functions
    # only need the ArgumentParser interface.
    groups = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from controlplane.cli import connection, habits

    connection.add_connection_args(parser)
    habits.add_global_args(parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"controlplane.cli.{name}").register(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see module docstring)."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words == ["--version"]:  # answered before any command module is imported
        print(program_version("mixfleetctl"))
        return EXIT_OK
    parser = build_parser()
    try:
        args = parser.parse_args(words)
        from controlplane.cli import habits, interrupt

        if argv is None and not interrupt.handles_its_own_signals(args):
            # a process of its own: Ctrl-C ends it in one line, workers and all
            interrupt.exit_on_interrupt(workers=hasattr(args, "workers"))
        habits.apply_global_args(args)
        handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
        if handler is None:  # a registered group without leaf commands
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return handler(args)
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except InfeasibleError as exc:
        print(f"error: infeasible: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MixfleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `mixfleetctl ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    finally:  # a Ctrl-C being handled ends the process with 130, not this return
        interrupt_module = sys.modules.get("controlplane.cli.interrupt")
        if interrupt_module is not None:
            interrupt_module.hold_if_leaving()
