"""The controller: the reconcile loop and the state behind the gRPC services.

:class:`Controller` (:mod:`.facade`) is the one object the servicers call; it is a thin
front over parts that each own their state: :mod:`.nodes` (registry and liveness),
:mod:`.solves` (solver pool, running solves, failures), :mod:`.rollout` (two-phase rollout,
committed plans, acks), :mod:`.loads` (load windows, imbalance samples, rebalance timing)
and :mod:`.watchers` (assignment streams, plan and routing watchers). :mod:`.common` holds
the settings and the messages they share.
"""

from controlplane.server.controller.common import (
    AssignmentEvent,
    ControllerSettings,
    NodeHealth,
    NodeView,
    Phase,
    RegisterResult,
)
from controlplane.server.controller.facade import Controller

__all__ = [
    "AssignmentEvent",
    "Controller",
    "ControllerSettings",
    "NodeHealth",
    "NodeView",
    "Phase",
    "RegisterResult",
]
