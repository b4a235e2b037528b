"""The node agent: discover -> Register -> Heartbeat + WatchAssignments -> apply -> Ack.

One :class:`Agent` speaks for one node (see proto/mixfleet/v1/agent.proto for the protocol
it follows). Its life:

1. discover the node (a discovery backend, in a worker thread);
2. ``Register`` (retried with jittered exponential backoff while the controller is
   unreachable); the reply gives the session and the heartbeat period;
3. two loops run together until a re-register is needed or the agent stops:

   * heartbeat: every period (+-10 % jitter) send state, GPU health and the applied plan
     versions; on failure back off; a reply ``reregister = true`` ends the session;
   * watch: keep a ``WatchAssignments`` stream open (reopened with backoff when it
     breaks); PREPARE -> stage -> Ack PREPARED | FAILED; COMMIT -> switch -> Ack
     COMMITTED | FAILED; ABORT -> discard the staged part; REMOVE -> withdraw.

Failures are sorted the kopf way: an unreachable or restarting controller is temporary
(retry with backoff, forever); refused credentials or an inventory the controller rejects
are permanent (:class:`AgentFatalError`; the CLI exits non-zero with the reason).

Modules: :mod:`agents.agent.session` (the :class:`Agent` and its loops),
:mod:`agents.agent.connection` (settings, the gRPC channel, which status codes are
temporary and which fatal), :mod:`agents.agent.events` (what an agent reports to its
observers).
"""

from agents.agent.connection import AgentSettings, TlsFiles, make_channel
from agents.agent.events import AgentStats, AssignmentEvent, Observer
from agents.agent.session import Agent, AgentFatalError

__all__ = [
    "Agent",
    "AgentFatalError",
    "AgentSettings",
    "AgentStats",
    "AssignmentEvent",
    "Observer",
    "TlsFiles",
    "make_channel",
]
