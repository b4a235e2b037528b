"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does:
the one implementation the operator and the controller (``mixfleetctl controller run
--leader-elect``) share.

Every replica runs an :class:`LeaderElector`. Each ``retry_period_s`` it reads the Lease and
asks the pure :func:`decide` what to do: take a free or expired lease, renew its own, or
wait. Writes carry the Lease's resourceVersion, so when two replicas race for an expired
lease one gets 409 Conflict and stays a follower. A leader that cannot renew within
``renew_deadline_s`` steps down before the lease can expire for the others
(``renew_deadline_s < lease_duration_s``), so two leaders never write at once as long as
clocks advance at the same rate. On a clean shutdown the leader releases the lease
(empty holder) so a standby takes over at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from apis.kube.client import LEASES, Json, Kube
from apis.kube.errors import ApiError, ConflictError, OperatorError
from policies.errors import InputError

log = logging.getLogger("mixfleet.leader")


@dataclass(frozen=True)
class LeaderSettings:
    """Lease timing and identity.

    Attributes:
        lease_name: Lease object name.
        namespace: namespace of the Lease (the pod's own).
        identity: this replica's id (pod name).
        lease_duration_s: how long a lease is valid after its last renewal, seconds.
        renew_deadline_s: a leader that could not renew for this long steps down, seconds
            (must be < lease_duration_s).
        retry_period_s: time between two attempts, seconds.
    """

    lease_name: str = "mixfleet-operator"
    namespace: str = "mixfleet-system"
    identity: str = "operator"
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0


@dataclass(frozen=True)
class LeaseRecord:
    """The election fields of a Lease's spec.

    Attributes:
        holder: holderIdentity ("" when free).
        duration_s: leaseDurationSeconds.
        acquire_time: when the holder acquired it.
        renew_time: when the holder last renewed it.
        transitions: leaseTransitions (how often the holder changed).
    """

    holder: str
    duration_s: float
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int


@dataclass(frozen=True)
class LeaseDecision:
    """What to do with the lease.

    Attributes:
        action: ``create`` | ``update`` | ``wait``.
        record: the record to write (create/update).
        leader: this replica leads once the write succeeds.
    """

    action: str
    record: LeaseRecord | None
    leader: bool


def decide(
    current: LeaseRecord | None, identity: str, now: datetime, settings: LeaderSettings
) -> LeaseDecision:
    """Pure election step: take a missing, free or expired lease; renew our own; else wait."""
    if current is None:
        rec = LeaseRecord(identity, settings.lease_duration_s, now, now, 0)
        return LeaseDecision("create", rec, True)
    if current.holder == identity:
        rec = LeaseRecord(
            identity,
            settings.lease_duration_s,
            current.acquire_time or now,
            now,
            current.transitions,
        )
        return LeaseDecision("update", rec, True)
    expired = (
        not current.holder
        or current.renew_time is None
        or now >= current.renew_time + timedelta(seconds=current.duration_s)
    )
    if expired:
        rec = LeaseRecord(identity, settings.lease_duration_s, now, now, current.transitions + 1)
        return LeaseDecision("update", rec, True)
    return LeaseDecision("wait", None, False)


def _micro_time(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(s: str | None) -> datetime | None:
    if not s:
        return None
    t = datetime.fromisoformat(s.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def record_from_lease(lease: Json) -> LeaseRecord:
    """Read the election record of a Lease object."""
    spec = lease.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_s=float(spec.get("leaseDurationSeconds") or 0),
        acquire_time=_parse(spec.get("acquireTime")),
        renew_time=_parse(spec.get("renewTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def lease_spec(rec: LeaseRecord) -> Json:
    """The Lease spec of an election record."""
    return {
        "holderIdentity": rec.holder or None,
        "leaseDurationSeconds": round(rec.duration_s),
        "acquireTime": _micro_time(rec.acquire_time),
        "renewTime": _micro_time(rec.renew_time),
        "leaseTransitions": rec.transitions,
    }


class LeaderElector:
    """Runs the election in a thread; :meth:`is_leader` is the write guard.

    Args:
        kube: client for the Lease (its own write guard must be None).
        settings: timing and identity.
        on_started_leading: called (in the elector thread) when leadership is gained.
        on_stopped_leading: called when it is lost or released.
        clock: wall clock (UTC) for lease times; monotonic: for the renew deadline.
    """

    def __init__(
        self,
        kube: Kube,
        settings: LeaderSettings,
        *,
        on_started_leading: Callable[[], None] = lambda: None,
        on_stopped_leading: Callable[[], None] = lambda: None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < settings.renew_deadline_s < settings.lease_duration_s:
            raise InputError(
                f"the renew deadline ({settings.renew_deadline_s:g} s) must be above 0 and "
                f"shorter than the lease duration ({settings.lease_duration_s:g} s), or two "
                "replicas could lead at once. To fix: lower --renew-deadline-s or raise "
                "--lease-duration-s",
                field="renew_deadline_s",
            )
        self.kube = kube
        self.settings = settings
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.clock = clock
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._leading = False
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observed_holder = ""

    def is_leader(self) -> bool:
        """True while this replica holds the lease and renewed it within the deadline."""
        with self._lock:
            return self._leading and (
                self.monotonic() - self._renewed_at < self.settings.renew_deadline_s
            )

    @property
    def holder(self) -> str:
        """The holder last seen on the Lease."""
        return self._observed_holder

    def try_once(self) -> bool:
        """One election step; returns whether this replica leads afterwards."""
        s = self.settings
        started = self.monotonic()
        try:
            lease = self.kube.get(LEASES, s.lease_name, s.namespace)
            current = record_from_lease(lease) if lease is not None else None
            self._observed_holder = current.holder if current else ""
            decision = decide(current, s.identity, self.clock(), s)
            if decision.action != "wait" and decision.record is not None:
                body: Json = {
                    "apiVersion": LEASES.api_version,
                    "kind": LEASES.kind,
                    "metadata": {"name": s.lease_name, "namespace": s.namespace},
                    "spec": lease_spec(decision.record),
                }
                if decision.action == "create":
                    self.kube.create(LEASES, body)
                else:
                    assert lease is not None
                    body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
                    self.kube.replace(LEASES, body)
                self._observed_holder = s.identity
            won = decision.leader
        except ConflictError:
            won = False
        except (ApiError, OperatorError) as exc:
            log.warning("lease %s/%s: %s", s.namespace, s.lease_name, exc)
            won = None  # unknown: keep leading until the renew deadline passes
        self._transition(won, started)
        return self.is_leader()

    def _transition(self, won: bool | None, at: float) -> None:
        started = stopped = False
        with self._lock:
            if won:
                self._renewed_at = at
                started = not self._leading
                self._leading = True
            elif self._leading and (
                won is False
                or self.monotonic() - self._renewed_at >= self.settings.renew_deadline_s
            ):
                self._leading = False
                stopped = True
        if started:
            log.info("%s became the leader", self.settings.identity)
            self.on_started_leading()
        if stopped:
            log.info("%s stopped leading", self.settings.identity)
            self.on_stopped_leading()

    def release(self) -> None:
        """Give the lease up (clean shutdown) so a standby can take over at once."""
        s = self.settings
        was = False
        with self._lock:
            was, self._leading = self._leading, False
        if not was:
            return
        try:
            lease = self.kube.get(LEASES, s.lease_name, s.namespace)
            if lease is not None and record_from_lease(lease).holder == s.identity:
                rec = record_from_lease(lease)
                spec = lease_spec(
                    LeaseRecord("", 1.0, rec.acquire_time, self.clock(), rec.transitions)
                )
                body: Json = {
                    "apiVersion": LEASES.api_version,
                    "kind": LEASES.kind,
                    "metadata": {
                        "name": s.lease_name,
                        "namespace": s.namespace,
                        "resourceVersion": lease["metadata"]["resourceVersion"],
                    },
                    "spec": spec,
                }
                self.kube.replace(LEASES, body)
        except (ApiError, OperatorError) as exc:
            log.warning("releasing lease %s/%s: %s", s.namespace, s.lease_name, exc)
        self.on_stopped_leading()

    def run(self) -> None:
        """Election loop until :meth:`stop`."""
        while not self._stop.is_set():
            self.try_once()
            self._stop.wait(self.settings.retry_period_s)
        self.release()

    def start(self) -> None:
        """Run the loop in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name="leader-elector", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and release the lease."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
