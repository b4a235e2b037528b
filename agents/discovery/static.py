"""Static discovery: a node described in a Fleet file.

For simulated agents (``mixfleet-agent --simulate-fleet``) and for hardware NVML cannot see.
The file is the same YAML/JSON document ``mixfleetctl`` plans with (see
:func:`policies.hardware.fleet.parse_fleet`).
"""

from __future__ import annotations

from pathlib import Path

import structlog

from agents.discovery.base import DiscoveryError
from apis.documents import load_document, read_limited
from policies.errors import InputError
from policies.hardware.fleet import Fleet, parse_fleet
from policies.hardware.inventory import NodeInventory, inventory_from_node
from policies.limits import decode_utf8


def load_fleet_file(path: str | Path) -> Fleet:
    """Read and parse a Fleet file (YAML or JSON).

    Raises:
        DiscoveryError: the file cannot be read, is not YAML or is over a limit of
            :mod:`policies.limits`.
        InputError: the document is not a valid Fleet (the message names the field).
    """
    p = Path(path)
    where = f"fleet file {str(p)!r}"
    try:
        doc = load_document(decode_utf8(read_limited(p, "fleet", "fleet"), where), where, "yaml")
    except InputError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise DiscoveryError(
                f"cannot read {where}: no such file. To fix: pass an existing Fleet YAML, "
                "e.g. examples/fleets/mixed-24.yaml"
            ) from exc
        raise DiscoveryError(str(exc)) from exc
    fleet = parse_fleet(doc)
    for w in fleet.warnings:  # deprecated keys: still read, named with their replacement
        structlog.get_logger("mixfleet.agent").warning("fleet file", path=str(p), warning=w)
    return fleet


class StaticDiscovery:
    """A :class:`~agents.discovery.base.DiscoveryBackend` returning one node of a Fleet.

    Attributes:
        name: ``static``.
        fleet: the parsed fleet.
        node_name: the node this agent reports.
        simulated: mark the inventory simulated (no real hardware behind it).
    """

    name = "static"

    def __init__(self, fleet: Fleet, node_name: str, *, simulated: bool = False) -> None:
        names = [n.name for n in fleet.nodes]
        if node_name not in names:
            raise InputError(
                f"node {node_name!r} is not in fleet {fleet.name!r}. "
                f"To fix: pick one of {', '.join(names)}",
                field="node",
            )
        self.fleet = fleet
        self.node_name = node_name
        self.simulated = simulated

    @classmethod
    def from_file(
        cls, path: str | Path, node_name: str, *, simulated: bool = False
    ) -> StaticDiscovery:
        """Backend for ``node_name`` of the Fleet file at ``path``.

        Raises:
            DiscoveryError: unreadable file.
            InputError: invalid fleet or unknown node.
        """
        return cls(load_fleet_file(path), node_name, simulated=simulated)

    def discover(self) -> NodeInventory:
        return inventory_from_node(self.fleet.node(self.node_name), simulated=self.simulated)


def discover_fleet(fleet: Fleet, *, simulated: bool = True) -> list[NodeInventory]:
    """One inventory per node of a fleet, in fleet order (``--simulate-fleet``)."""
    return [inventory_from_node(n, simulated=simulated) for n in fleet.nodes]
