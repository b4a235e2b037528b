"""Fleet description: nodes, their GPUs, NVLink domains and network interfaces.

The same content a node agent reports (controlplane) or a Fleet file declares. Parsing
takes an already-loaded document (a dict), so this module does no I/O.

Units are in every field name: ``_gbytes_per_s`` is gigabytes per second (NVLink,
bidirectional per GPU like datasheets), ``_gbits_per_s`` is gigabits per second (NICs and
fabric links, per direction like port rates); GiB for memory.

Fleet files written before the unit rename (``per_gpu_gbps``, ``gbps``,
``hbm_bandwidth_gbps``, ``nvlink_per_gpu_gbps``, ``pcie_gbps``) still parse: each old key
is read as its new name and :attr:`Fleet.warnings` carries one deprecation message per
key, naming the new key, for the caller to show (the CLI prints them to stderr).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NewType

from policies.errors import InputError
from policies.hardware.catalog import GpuSpec, lookup
from policies.keys import check_keys, renamed_keys
from policies.limits import (
    MAX_FLEET_GPUS,
    MAX_FLEET_NODES,
    MAX_GPUS_PER_NODE,
    MAX_NICS_PER_NODE,
    bounded_int,
)

GpuId = NewType("GpuId", str)

API_VERSION = "mixfleet.io/v1alpha1"
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class NvLinkDomain:
    """An NVLink (or NVSwitch / Infinity Fabric) domain a node's GPUs belong to.

    Attributes:
        domain: domain name; GPUs with the same name talk over NVLink, across nodes too
            (multi-node NVLink such as NVL72).
        per_gpu_bidir_gbytes_per_s: NVLink bandwidth per GPU, bidirectional GB/s.
    """

    domain: str
    per_gpu_bidir_gbytes_per_s: float


@dataclass(frozen=True)
class NicGroup:
    """Identical RDMA NICs of a node.

    Attributes:
        count: number of NICs.
        per_direction_gbits_per_s: port rate per NIC, Gb/s per direction (400 for NDR).
        fabric: fabric (network segment) name; nodes on the same fabric talk RDMA.
        link_layer: ``infiniband`` or ``ethernet`` (RoCE).
    """

    count: int
    per_direction_gbits_per_s: float
    fabric: str
    link_layer: str = "infiniband"


@dataclass(frozen=True)
class Gpu:
    """One GPU in the fleet.

    Attributes:
        id: ``<node>/gpu<index>``.
        node: node name.
        index: index within the node.
        spec: capabilities (catalog entry with per-node overrides and measured figures).
        uuid: hardware UUID when known (agents report it).
    """

    id: GpuId
    node: str
    index: int
    spec: GpuSpec
    uuid: str = ""


@dataclass(frozen=True)
class Node:
    """A host with GPUs.

    Attributes:
        name: node name (DNS-1123 label).
        gpus: the node's GPUs, in index order.
        nvlink: NVLink domain, or None for PCIe-only nodes.
        nics: RDMA NIC groups.
        labels: free-form labels (``rack``, ``tier``...).
    """

    name: str
    gpus: tuple[Gpu, ...]
    nvlink: NvLinkDomain | None
    nics: tuple[NicGroup, ...]
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def rdma_per_direction_gbits_per_s(self) -> float:
        """Total RDMA port rate of the node, Gb/s per direction."""
        return sum(n.count * n.per_direction_gbits_per_s for n in self.nics)

    @property
    def fabrics(self) -> tuple[str, ...]:
        """Fabric names the node's NICs attach to."""
        return tuple(sorted({n.fabric for n in self.nics}))


@dataclass(frozen=True)
class FabricLink:
    """A link joining two fabrics (segments), e.g. a spine between two IB pods.

    Attributes:
        a, b: fabric names.
        per_direction_gbits_per_s: aggregate bandwidth of the link, Gb/s per direction.
        latency_us: added one-way latency, microseconds.
    """

    a: str
    b: str
    per_direction_gbits_per_s: float
    latency_us: float = 5.0


@dataclass(frozen=True)
class Fleet:
    """A set of nodes. ``gpus`` lists every GPU in node order."""

    name: str
    nodes: tuple[Node, ...]
    fabric_links: tuple[FabricLink, ...] = ()
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """Deprecation messages from parsing (old unit keys), one per key occurrence; not part
    of the fleet's identity (two fleets differing only here are equal)."""

    @cached_property
    def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU in node order (computed once: planners index it per GPU)."""
        return tuple(g for n in self.nodes for g in n.gpus)

    @cached_property
    def _by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> Node:
        """The node called ``name``.

        Raises:
            KeyError: no such node.
        """
        return self._by_name[name]

    def without_nodes(self, names: Sequence[str]) -> Fleet:
        """The fleet less some nodes (failed or cordoned)."""
        drop = set(names)
        return Fleet(
            self.name,
            tuple(n for n in self.nodes if n.name not in drop),
            self.fabric_links,
            self.warnings,
        )


# ---------------------------------------------------------------------- reachability


def _fabric_groups(fleet: Fleet) -> dict[str, str]:
    """Fabric -> its group: fabrics joined by a chain of fabric links share a group."""
    parent: dict[str, str] = {}

    def root(f: str) -> str:
        parent.setdefault(f, f)
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    for link in fleet.fabric_links:
        parent[root(link.a)] = root(link.b)
    return {f: root(f) for n in fleet.nodes for f in n.fabrics}


def _domain(node: Node) -> str | None:
    return node.nvlink.domain if node.nvlink is not None else None


def _split_by_domain(a: Sequence[Node], b: Sequence[Node]) -> tuple[Node, Node] | None:
    """A node of ``a`` and another of ``b`` in no common NVLink domain, or None when all
    are in one domain (``a is b``: two nodes of one list)."""
    first, domain = a[0], _domain(a[0])
    for other in b if a is not b else a[1:]:
        if domain is None or _domain(other) != domain:
            return first, other
    return next(((x, b[0]) for x in a[1:] if _domain(x) != domain and a is not b), None)


def unreachable_pair(fleet: Fleet) -> tuple[Node, Node] | None:
    """Two nodes whose GPUs have no channel between them, or None when every pair has one.

    Two nodes reach each other when they share an NVLink domain, a fabric, or fabrics
    joined by a chain of fabric links (the channels of :mod:`policies.hardware.topology`). Nodes are
    grouped by the fabric groups they reach, so the check costs groups squared, not nodes
    squared.
    """
    group = _fabric_groups(fleet)
    classes: dict[frozenset[str], list[Node]] = {}
    for node in fleet.nodes:
        classes.setdefault(frozenset(group[f] for f in node.fabrics), []).append(node)
    keys = list(classes)
    for i, ka in enumerate(keys):
        for kb in keys[i:]:
            if ka & kb or (ka is kb and len(classes[ka]) < 2):
                continue
            pair = _split_by_domain(classes[ka], classes[kb])
            if pair is not None:
                return pair
    return None


def _reach_of(node: Node) -> str:
    fabrics = f"fabric {', '.join(node.fabrics)}" if node.fabrics else "no NICs"
    nvlink = f"NVLink domain {_domain(node)}" if node.nvlink else "no NVLink"
    return f"{node.name}: {fabrics} and {nvlink}"


def check_reachable(fleet: Fleet, *, field: str = "nodes") -> None:
    """Refuse a fleet in which some two nodes cannot exchange expert traffic (a plan would
    price their all-to-all as infinite). The one check of every entry point: Fleet files
    (:func:`parse_fleet`), the controller's and the operator's fleets of reported nodes
    (:func:`policies.request.check_request` before every solve).

    Raises:
        InputError: naming the first such pair, what each node reaches, and the fix.
    """
    pair = unreachable_pair(fleet)
    if pair is None:
        return
    a, b = pair
    raise InputError(
        f"nodes {a.name!r} and {b.name!r} cannot reach each other: they share no NVLink "
        f"domain, no fabric and no fabric link ({_reach_of(a)}; {_reach_of(b)}). To fix: "
        "give both NICs on one fabric (nics: [{count: N, per_direction_gbits_per_s: R, "
        "fabric: NAME}]), join their fabrics (spec.fabric_links: [{between: [F1, F2], "
        "per_direction_gbits_per_s: R}]), put them in one NVLink domain, or plan them as "
        "separate fleets (a node selector)",
        field=field,
    )


# --------------------------------------------------------------------------- parsing


def _req(doc: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in doc:
        raise InputError(f"missing required field {key!r}", field=path)
    return doc[key]


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InputError(f"must be a mapping, got {type(value).__name__}", field=path)
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise InputError(f"must be a list, got {type(value).__name__}", field=path)
    return value


def positive_number(value: Any, path: str, *, allow_zero: bool = False) -> float:
    """Validate a finite positive number (or non-negative with ``allow_zero``).

    Raises:
        InputError: not a number, NaN, infinite, negative (or zero).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"must be a number, got {value!r}", field=path)
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise InputError(f"must be finite, got {value!r}", field=path)
    if v < 0 or (v == 0 and not allow_zero):
        raise InputError(f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}", field=path)
    return v


def positive_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"must be a positive integer, got {value!r}", field=path)
    return value


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or len(value) > 63:
        raise InputError(
            f"must be a DNS-1123 name (lower-case letters, digits, '-', '.'; at most 63 "
            f"characters), got {value!r}",
            field=path,
        )
    return value


_GPU_KEYS = {"model", "count", "base", "uuids"}
# The keys each level of a Fleet document may hold (deprecated unit keys are renamed first).
_TOP_KEYS = ("apiVersion", "kind", "metadata", "spec")
_METADATA_KEYS = ("name", "labels", "annotations")
_SPEC_KEYS = ("nodes", "fabric_links")
_NODE_KEYS = ("name", "labels", "gpus", "nvlink", "nics")
_NVLINK_KEYS = ("domain", "per_gpu_bidir_gbytes_per_s")
_NIC_KEYS = ("count", "per_direction_gbits_per_s", "fabric", "link_layer")
_FABRIC_LINK_KEYS = ("between", "per_direction_gbits_per_s", "latency_us")

# Keys renamed so the unit cannot be misread: old key -> new key, per section.
LEGACY_GPU_KEYS = {
    "hbm_bandwidth_gbps": "hbm_bandwidth_gbytes_per_s",
    "nvlink_per_gpu_gbps": "nvlink_bidir_gbytes_per_s",
    "pcie_gbps": "pcie_per_direction_gbytes_per_s",
}
LEGACY_NVLINK_KEYS = {"per_gpu_gbps": "per_gpu_bidir_gbytes_per_s"}
LEGACY_NIC_KEYS = {"gbps": "per_direction_gbits_per_s"}
LEGACY_FABRIC_LINK_KEYS = {"gbps": "per_direction_gbits_per_s"}


def _parse_gpu_group(doc: Mapping[str, Any], path: str) -> tuple[GpuSpec, int, list[str]]:
    check_keys(doc, _GPU_KEYS | GpuSpec.figure_names(), path, what="GPU field")
    model = _req(doc, "model", path)
    if not isinstance(model, str) or not model:
        raise InputError("must be a non-empty string", field=f"{path}.model")
    count = bounded_int(doc.get("count", 1), f"{path}.count", maximum=MAX_GPUS_PER_NODE)
    overrides = {k: v for k, v in doc.items() if k not in _GPU_KEYS}
    if "base" in doc:
        base = lookup(str(doc["base"]), field_path=f"{path}.base")
        spec = replace(base.with_overrides(overrides, field_path=path), model=model)
    else:
        spec = lookup(model, field_path=f"{path}.model").with_overrides(overrides, field_path=path)
    if spec.memory_gib <= 0 or spec.hbm_bandwidth_gbytes_per_s <= 0 or spec.bf16_tflops <= 0:
        raise InputError(
            "memory_gib, hbm_bandwidth_gbytes_per_s and bf16_tflops must be > 0", field=path
        )
    uuids = doc.get("uuids", [])
    uuids = [str(u) for u in _list(uuids, f"{path}.uuids")]
    if uuids and len(uuids) != count:
        raise InputError(f"gives {len(uuids)} uuids for {count} GPUs", field=f"{path}.uuids")
    return spec, count, uuids


def parse_node(
    doc: Mapping[str, Any], path: str = "node", warnings: list[str] | None = None
) -> Node:
    """Parse one node entry of a Fleet spec (see :func:`parse_fleet`).

    Args:
        doc: the node entry.
        path: field path of the entry, for error and deprecation messages.
        warnings: deprecation messages (old unit keys) are appended here; None drops them.
    """
    warnings = [] if warnings is None else warnings
    doc = _mapping(doc, path)
    check_keys(doc, _NODE_KEYS, path)
    name = _name(_req(doc, "name", path), f"{path}.name")
    labels_raw = _mapping(doc.get("labels", {}) or {}, f"{path}.labels")
    labels = {str(k): str(v) for k, v in labels_raw.items()}
    gpus: list[Gpu] = []
    for i, g in enumerate(_list(_req(doc, "gpus", path), f"{path}.gpus")):
        gpath = f"{path}.gpus[{i}]"
        group = renamed_keys(_mapping(g, gpath), LEGACY_GPU_KEYS, gpath, warnings)
        spec, count, uuids = _parse_gpu_group(group, gpath)
        if len(gpus) + count > MAX_GPUS_PER_NODE:  # checked before the GPUs are made
            raise InputError(
                f"the node's GPU groups add up to more than {MAX_GPUS_PER_NODE:,} GPUs",
                field=f"{gpath}.count",
            )
        for j in range(count):
            idx = len(gpus)
            gpus.append(Gpu(GpuId(f"{name}/gpu{idx}"), name, idx, spec, uuids[j] if uuids else ""))
    if not gpus:
        raise InputError("a node needs at least one GPU", field=f"{path}.gpus")
    nvlink = None
    if doc.get("nvlink") is not None:
        nv = renamed_keys(
            _mapping(doc["nvlink"], f"{path}.nvlink"),
            LEGACY_NVLINK_KEYS,
            f"{path}.nvlink",
            warnings,
        )
        check_keys(nv, _NVLINK_KEYS, f"{path}.nvlink")
        domain = str(nv.get("domain", name))
        nvlink = NvLinkDomain(
            domain,
            positive_number(
                _req(nv, "per_gpu_bidir_gbytes_per_s", f"{path}.nvlink"),
                f"{path}.nvlink.per_gpu_bidir_gbytes_per_s",
            ),
        )
    nics: list[NicGroup] = []
    for i, n in enumerate(_list(doc.get("nics", []) or [], f"{path}.nics")):
        npath = f"{path}.nics[{i}]"
        n = renamed_keys(_mapping(n, npath), LEGACY_NIC_KEYS, npath, warnings)
        check_keys(n, _NIC_KEYS, npath)
        layer = str(n.get("link_layer", "infiniband")).lower()
        if layer not in ("infiniband", "ethernet"):
            raise InputError(
                f"must be 'infiniband' or 'ethernet' (RoCE), got {layer!r}",
                field=f"{npath}.link_layer",
            )
        nics.append(
            NicGroup(
                bounded_int(n.get("count", 1), f"{npath}.count", maximum=MAX_NICS_PER_NODE),
                positive_number(
                    _req(n, "per_direction_gbits_per_s", npath),
                    f"{npath}.per_direction_gbits_per_s",
                ),
                str(_req(n, "fabric", npath)),
                layer,
            )
        )
    return Node(name, tuple(gpus), nvlink, tuple(nics), labels)


def _check_fleet_size(raw_nodes: Sequence[Any]) -> None:
    """Refuse a fleet over :data:`~policies.limits.MAX_FLEET_NODES` nodes or
    :data:`~policies.limits.MAX_FLEET_GPUS` GPUs before any node is expanded into GPUs
    (counts that are not integers are left to :func:`parse_node` to name)."""
    if len(raw_nodes) > MAX_FLEET_NODES:
        raise InputError(
            f"has {len(raw_nodes):,} nodes, over the limit of {MAX_FLEET_NODES:,}. To fix: "
            "plan a part of the fleet (node selectors) at a time",
            field="spec.nodes",
        )
    total = 0
    for node in raw_nodes:
        groups = node.get("gpus") if isinstance(node, Mapping) else None
        for g in groups if isinstance(groups, list) else ():
            count = g.get("count", 1) if isinstance(g, Mapping) else 1
            if isinstance(count, int) and count > 0:
                total += count
    if total > MAX_FLEET_GPUS:
        raise InputError(
            f"counts add up to {total:,} GPUs, over the limit of {MAX_FLEET_GPUS:,}. To fix: "
            "plan a part of the fleet (node selectors) at a time",
            field="spec.nodes",
        )


def _fabric_link(raw: Any, path: str, fabrics: set[str], warnings: list[str]) -> FabricLink:
    """One entry of ``spec.fabric_links`` (``fabrics``: the fabrics the nodes use)."""
    raw = renamed_keys(_mapping(raw, path), LEGACY_FABRIC_LINK_KEYS, path, warnings)
    check_keys(raw, _FABRIC_LINK_KEYS, path)
    between = _list(_req(raw, "between", path), f"{path}.between")
    if len(between) != 2 or not all(str(b) in fabrics for b in between):
        raise InputError(
            f"must name two fabrics used by the nodes ({sorted(fabrics)}), got {between!r}",
            field=f"{path}.between",
        )
    rate = _req(raw, "per_direction_gbits_per_s", path)
    return FabricLink(
        str(between[0]),
        str(between[1]),
        positive_number(rate, f"{path}.per_direction_gbits_per_s"),
        positive_number(raw.get("latency_us", 5.0), f"{path}.latency_us", allow_zero=True),
    )


def parse_fleet(doc: Any) -> Fleet:
    """Parse a Fleet document (already loaded from YAML or JSON).

    Schema::

        apiVersion: mixfleet.io/v1alpha1
        kind: Fleet
        metadata: {name: NAME}
        spec:
          nodes:
          - name: a100-0
            labels: {rack: r1}
            gpus: [{model: A100-SXM4-80GB, count: 8, <catalog field>: <override>}]
            nvlink: {domain: a100-0, per_gpu_bidir_gbytes_per_s: 600}   # omit for PCIe-only nodes
            nics: [{count: 4, per_direction_gbits_per_s: 400, fabric: ib0}]
          fabric_links: [{between: [ib0, ib1], per_direction_gbits_per_s: 800, latency_us: 5}]   # optional

    Deprecated unit keys are accepted and reported in :attr:`Fleet.warnings`.

    Raises:
        InputError: naming the field (``spec.nodes[1].gpus[0].model``) and the fix.
    """
    warnings: list[str] = []
    doc = _mapping(doc, "fleet")
    check_keys(doc, _TOP_KEYS, "")
    api = doc.get("apiVersion", API_VERSION)
    if api != API_VERSION:
        raise InputError(f"must be {API_VERSION!r}, got {api!r}", field="apiVersion")
    kind = doc.get("kind", "Fleet")
    if kind != "Fleet":
        raise InputError(f"must be 'Fleet', got {kind!r}", field="kind")
    meta = _mapping(doc.get("metadata", {}) or {}, "metadata")
    check_keys(meta, _METADATA_KEYS, "metadata")
    name = _name(meta.get("name", "fleet"), "metadata.name")
    spec = _mapping(_req(doc, "spec", "fleet"), "spec")
    check_keys(spec, _SPEC_KEYS, "spec")
    raw_nodes = _list(_req(spec, "nodes", "spec"), "spec.nodes")
    if not raw_nodes:
        raise InputError("a fleet needs at least one node", field="spec.nodes")
    _check_fleet_size(raw_nodes)
    nodes = tuple(parse_node(n, f"spec.nodes[{i}]", warnings) for i, n in enumerate(raw_nodes))
    seen: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.name in seen:
            raise InputError(
                f"duplicate node name {n.name!r} (also spec.nodes[{seen[n.name]}])",
                field=f"spec.nodes[{i}].name",
            )
        seen[n.name] = i
    uuids: dict[str, str] = {}
    for n in nodes:
        for g in n.gpus:
            if g.uuid:
                if g.uuid in uuids:
                    raise InputError(
                        f"duplicate GPU uuid {g.uuid!r} on {g.id} and {uuids[g.uuid]}",
                        field="spec.nodes",
                    )
                uuids[g.uuid] = g.id
    fabrics = {f for n in nodes for f in n.fabrics}
    raw_links = _list(spec.get("fabric_links", []) or [], "spec.fabric_links")
    links = tuple(
        _fabric_link(x, f"spec.fabric_links[{i}]", fabrics, warnings)
        for i, x in enumerate(raw_links)
    )
    fleet = Fleet(name, nodes, links, tuple(warnings))
    check_reachable(fleet, field="spec.nodes")
    return fleet


def fleet_to_doc(fleet: Fleet) -> dict[str, Any]:
    """The inverse of :func:`parse_fleet`: one GPU group per GPU with its full spec."""
    nodes: list[dict[str, Any]] = []
    for n in fleet.nodes:
        gpus: list[dict[str, Any]] = []
        for g in n.gpus:
            entry: dict[str, Any] = {"model": g.spec.model, "count": 1}
            base = None
            try:
                base = lookup(g.spec.model)
            except InputError:
                base = None
            if base is None:
                entry["base"] = "H100-SXM5-80GB"
                base = lookup("H100-SXM5-80GB")
            for f_name, value in vars(g.spec).items():
                if f_name in ("model", "vendor", "architecture", "compute_capability"):
                    continue
                if getattr(base, f_name) != value:
                    entry[f_name] = value
            if g.uuid:
                entry["uuids"] = [g.uuid]
            gpus.append(entry)
        node: dict[str, Any] = {"name": n.name, "labels": dict(n.labels), "gpus": gpus}
        if n.nvlink:
            node["nvlink"] = {
                "domain": n.nvlink.domain,
                "per_gpu_bidir_gbytes_per_s": n.nvlink.per_gpu_bidir_gbytes_per_s,
            }
        node["nics"] = [
            {
                "count": x.count,
                "per_direction_gbits_per_s": x.per_direction_gbits_per_s,
                "fabric": x.fabric,
                "link_layer": x.link_layer,
            }
            for x in n.nics
        ]
        nodes.append(node)
    spec: dict[str, Any] = {"nodes": nodes}
    if fleet.fabric_links:
        spec["fabric_links"] = [
            {
                "between": [x.a, x.b],
                "per_direction_gbits_per_s": x.per_direction_gbits_per_s,
                "latency_us": x.latency_us,
            }
            for x in fleet.fabric_links
        ]
    return {
        "apiVersion": API_VERSION,
        "kind": "Fleet",
        "metadata": {"name": fleet.name},
        "spec": spec,
    }
