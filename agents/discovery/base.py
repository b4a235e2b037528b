"""The discovery backend contract."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from policies.hardware.inventory import NodeInventory


class DiscoveryError(Exception):
    """Discovery could not run (no driver, no permission); the message says what to do."""


class DiscoveryBackend(Protocol):
    """Something that can describe the local node.

    Attributes:
        name: backend name (``nvml``, ``static``, ``sysfs``).
    """

    name: str

    def discover(self) -> NodeInventory:
        """Describe the node now.

        Raises:
            DiscoveryError: the backend cannot run here.
        """
        ...


def recording_main(
    argv: Sequence[str] | None,
    description: str,
    record_node: Callable[..., Mapping[str, Any]],
) -> int:
    """Shared ``python -m agents.discovery.<backend> [--node NAME] [--out FILE]`` entry point:
    print or write what a backend's discovery reports (inventory plus raw answers, usable
    as a test fixture). Returns the exit status (2 when the backend cannot run here)."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    parser.add_argument("--node", default="", help="node name (default: host name)")
    parser.add_argument("--out", default="", help="write JSON here instead of stdout")
    args = parser.parse_args(argv)
    try:
        doc = record_node(node_name=args.node)
    except DiscoveryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        print(text)
    return 0
