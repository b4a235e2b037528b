"""What every schedule must satisfy, as a list of violations (empty = valid): no node's
memory over-committed, each deployment only on nodes it may use, each instance a runnable
candidate laid on the right node groups, GPU bounds and namespace quotas kept.

Pure: no I/O.
"""

from __future__ import annotations

from policies.scheduling.types import Schedule, ScheduleRequest


def violations(req: ScheduleRequest, schedule: Schedule) -> list[str]:
    """Every rule ``schedule`` breaks, in words."""
    out: list[str] = []
    by_name = {d.name: d for d in req.demands}
    group_of = {n: ti for ti, g in enumerate(req.groups) for n in g.nodes}
    gpus_of = {n: g.gpus_per_node for g in req.groups for n in g.nodes}
    load: dict[str, float] = {}
    ns_gpus: dict[str, float] = {}
    for name, p in schedule.placements.items():
        d = by_name.get(name)
        if d is None:
            out.append(f"{name}: placed but not requested")
            continue
        flat = [n for inst in p.instances for n in inst]
        if len(flat) != len(set(flat)) or set(flat) != set(p.nodes):
            out.append(f"{name}: instances do not partition its nodes")
        if not set(p.nodes) <= d.eligible:
            out.append(f"{name}: on nodes it may not use {sorted(set(p.nodes) - d.eligible)}")
        if len(p.instances) > d.max_instances:
            out.append(f"{name}: {len(p.instances)} instances above {d.max_instances}")
        cands = {c.counts: c for c in req.candidates.get(name, ()) if c.ok}
        for inst in p.instances:
            counts = [0] * len(req.groups)
            for n in inst:
                counts[group_of[n]] += 1
            if tuple(counts) not in cands:
                out.append(f"{name}: instance {inst} is no runnable candidate")
        gpus = sum(gpus_of[n] for n in p.nodes)
        if d.max_gpus and gpus > d.max_gpus:
            out.append(f"{name}: {gpus} GPUs above maxGpus {d.max_gpus}")
        if gpus < d.min_gpus:
            out.append(f"{name}: {gpus} GPUs below minGpus {d.min_gpus}")
        for n in p.nodes:
            load[n] = load.get(n, 0.0) + d.memory_fraction
        ns_gpus[d.namespace] = ns_gpus.get(d.namespace, 0.0) + gpus * d.memory_fraction
    out.extend(
        f"node {n}: memory fractions sum to {v:g} > 1 ({', '.join(schedule.holder(n))})"
        for n, v in sorted(load.items())
        if v > 1 + 1e-9
    )
    out.extend(
        f"namespace {ns}: {used:g} GPUs above its quota {req.quotas_gpus[ns]}"
        for ns, used in sorted(ns_gpus.items())
        if ns in req.quotas_gpus and used > req.quotas_gpus[ns] + 1e-9
    )
    out.extend(f"{n}: pending and placed" for n in schedule.pending if n in schedule.placements)
    missing = set(by_name) - set(schedule.placements) - set(schedule.pending)
    out.extend(f"{n}: neither placed nor pending" for n in sorted(missing))
    return out
