"""A launch recipe rendered: ``sh`` words, one node's command, the script every node of a
plan runs, and the recipe as plain JSON values.

Pure: builds text, does no I/O.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from policies.launch.types import LaunchRecipe, NodeLaunch

_REF_TOKEN = re.compile(
    r'^(?:[^"`\\$]|\$\{[A-Z_][A-Z0-9_]*(?:(?:%|%%|#|##|:-|:\?)[^}"`\\$]*)?\})*$'
)


def shell_word(token: str) -> str:
    """``token`` quoted for ``sh``: single quotes, or double quotes when it holds one of the
    ``${...}`` references (so the shell expands it and nothing else)."""
    if "${" in token and _REF_TOKEN.match(token):
        return f'"{token}"'
    return shlex.quote(token)


def node_command(launch: NodeLaunch) -> str:
    """One node's environment and command as one ``sh`` command, a flag per line."""
    words = [f"{k}={shell_word(v)}" for k, v in launch.env.items()]
    words += [shell_word(t) for t in launch.argv]
    lines: list[str] = []
    for w in words:
        if lines and not w.startswith("--"):
            lines[-1] += " " + w
        else:
            lines.append(w)
    return " \\\n    ".join(lines)


def launch_script(recipe: LaunchRecipe, *, node_var: str = "MIXFLEET_NODE") -> str:
    """An ``sh`` script that runs this node's launch, the node named by ``$node_var``."""
    names = ", ".join(n.node for n in recipe.nodes)
    out = [
        "#!/bin/sh",
        f"# plan {recipe.plan_id} on {recipe.engine}, written by mixfleet: set {node_var} to",
        "# this node's name and run it on every node of the plan.",
        *(f"# note: {n}" for n in recipe.notes),
        "set -eu",
        f'case "${{{node_var}:?set {node_var} to the name of this node}}" in',
    ]
    for n in recipe.nodes:
        env = " ".join(f"{k}={shell_word(v)}" for k, v in n.env.items())
        argv = " ".join(shell_word(t) for t in n.argv)
        out += [f"  {shlex.quote(n.node)})", f"    export {env}", f"    exec {argv}", "    ;;"]
    out += [
        "  *)",
        f'    echo "node ${node_var} is not in plan {recipe.plan_id} (nodes: {names})" >&2',
        "    exit 1",
        "    ;;",
        "esac",
    ]
    return "\n".join(out) + "\n"


def failing_script(reason: str) -> str:
    """An ``sh`` script that refuses to start, saying why (a plan no recipe exists for)."""
    return f"#!/bin/sh\necho {shlex.quote('mixfleet: no launch recipe: ' + reason)} >&2\nexit 1\n"


def recipe_to_doc(recipe: LaunchRecipe) -> dict[str, Any]:
    """The recipe as plain JSON values."""
    pd: dict[str, Any] = {}
    if recipe.role != "aggregated":
        kv: dict[str, Any] = {"backend": recipe.transfer_backend}
        if recipe.bootstrap_port is not None:
            kv["bootstrap_port"] = recipe.bootstrap_port
        pd["kv_transfer"] = kv
    return {
        "plan_id": recipe.plan_id,
        "engine": recipe.engine,
        "role": recipe.role,
        **pd,
        "nodes": [
            {
                "node": n.node,
                "node_rank": n.node_rank,
                "ranks": list(n.rank_range),
                "argv": list(n.argv),
                "env": dict(n.env),
            }
            for n in recipe.nodes
        ],
        "files": {k: dict(v) for k, v in recipe.files.items()},
        "notes": list(recipe.notes),
    }
