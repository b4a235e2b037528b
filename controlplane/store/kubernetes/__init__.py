"""The controller's store on the Kubernetes API (``kubernetes:NAMESPACE``).

In a cluster the controller keeps its state in the mixfleet.io custom resources, so
``kubectl`` shows what the controller knows and the operator (operators/) and the controller
work on the same objects:

===================  ====================================================================
store                Kubernetes
===================  ====================================================================
node                 GPUNode (cluster-scoped): status.inventory, health, heartbeat and
                     status.agent (session, registration time, state, message, applied)
deployment           ModelDeployment in NAMESPACE: spec is the deployment document
                     (policies.spec.build), metadata.generation the generation,
                     status.controller the controller's status, status.committedVersion
                     the committed pointer
plan version         PartitionPlan ``<deployment>-v<version>`` (madeBy: controller), owned
                     by its ModelDeployment; status.state / reason / stateChangedTime /
                     prepareDeadline the rollout state
ack                  PartitionPlan status.acks (one entry per node and state) and
                     status.nodes (each node's latest state, what the operator reads)
load window          ConfigMap ``<deployment>-expert-load`` (owned by the deployment),
                     the newest windows up to about 900 KB
controller id        ConfigMap ``mixfleet-controller``
version counter      ConfigMap ``mixfleet-plan-versions`` (apis.kube.versions)
===================  ====================================================================

Differences from the SQLite store, all forced by Kubernetes semantics:

* Deleting a deployment deletes the ModelDeployment: its PartitionPlans and ConfigMaps are
  garbage-collected, so ``include_deleted`` finds nothing. Versions still only grow across
  delete and re-create (the version counter survives).
* :meth:`KubernetesStore.commit_plan` writes several objects; the committed pointer
  (ModelDeployment ``status.committedVersion``) is written first and is the truth. Plan
  states that a crash left stale are repaired by the next commit.
* Times are stored as RFC 3339 with microseconds (exact to 1 us).

Every write is a server-side apply under the field manager ``mixfleet-controller`` (status
writes of acks and counters are resourceVersion-guarded merge patches retried on 409), so
the operator's fields and the controller's never overwrite each other.

The store is put together (:mod:`.store`) from one part per kind of object: :mod:`.nodes`,
:mod:`.deployments` (with the committed pointer), :mod:`.plans`, :mod:`.acks_loads`; they
share :mod:`.common` (names, state spellings, time format, API access).
"""

from controlplane.store.kubernetes.common import from_time, to_time
from controlplane.store.kubernetes.store import KubernetesStore

__all__ = ["KubernetesStore", "from_time", "to_time"]
