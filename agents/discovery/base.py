"""The discovery backend contract."""

from __future__ import annotations

from typing import Protocol

from agents.inventory import NodeInventory


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
