"""``mixfleetctl deploy apply|get|delete``: model deployments held by the controller.

``apply -f FILE`` sends every deployment document of a YAML file (``-`` = stdin); ``get``
lists them with their rollout phase, predicted figures, the deployment an engine instance
serves and how many instances a deployment has; ``get NAME`` shows one, then its engine
instances (role, pool, nodes, URL, committed version, state, planned share, batch limit,
predicted TTFT/TPOT) and its demand, planned vs measured by the routers (requests/s, prompt
and output lengths, observed TTFT/TPOT p99 against the plan's predictions); ``delete`` removes
one (exit 1 when it does not exist). ``get -o yaml|json`` prints ModelDeployment documents
(camelCase, as ``apply`` reads them, with the controller's ``status``, which ``apply``
drops), so ``deploy get NAME -o yaml > d.yaml; deploy apply -f d.yaml`` round-trips.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from controlplane.cli.connection import add_client, call, ms, to_json
from controlplane.cli.output import Groups, add_group, clip, emit, emit_document, table
from policies.errors import InputError

if TYPE_CHECKING:
    from mixfleet.v1 import engine_pb2, plan_pb2


def _read_docs(path: str) -> Iterator[Any]:
    """The deployment documents of a YAML file (``-`` = stdin), within the limits of
    :mod:`policies.limits` (size, UTF-8, nesting, no aliases, at most
    :data:`~policies.limits.MAX_DOCUMENTS_PER_FILE` documents). A ``status`` block (from
    ``deploy get -o yaml``) is dropped, as ``kubectl apply`` ignores it."""
    from apis.documents import load_yaml, read_limited
    from policies.limits import MAX_DOCUMENTS_PER_FILE, decode_utf8

    where = "deployments on stdin" if path == "-" else f"deployment file {path!r}"
    try:
        text = decode_utf8(read_limited(path, "deployment", "deployment"), where)
        for doc in load_yaml(text, where, max_documents=MAX_DOCUMENTS_PER_FILE):
            if isinstance(doc, dict) and doc.get("kind") == "List":  # deploy get -o yaml
                yield from (_without_status(d) for d in doc.get("items") or [])
            else:
                yield _without_status(doc)
    except InputError as exc:
        raise InputError(str(exc), field="-f") from exc


def _without_status(doc: Any) -> Any:
    if isinstance(doc, dict) and "status" in doc:
        return {k: v for k, v in doc.items() if k != "status"}
    return doc


def deployment_document(d: plan_pb2.Deployment) -> dict[str, Any]:
    """A deployment as the ModelDeployment document ``deploy apply`` reads (camelCase),
    with the controller's ``status`` (dropped again on apply)."""
    from apis.wire.deployment import spec_from_proto
    from policies.spec.build import spec_to_doc

    doc = spec_to_doc(spec_from_proto(d.spec))
    status = to_json(d.status, proto_names=False)
    status["generation"] = d.generation
    doc["status"] = status
    return doc


def cmd_deploy_apply(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2, plan_pb2_grpc

    from apis.wire.deployment import spec_to_proto
    from policies.spec.build import parse_deployment

    specs = [parse_deployment(doc) for doc in _read_docs(args.file)]
    if not specs:
        raise InputError(f"{args.file} holds no deployment", field="-f")
    docs = []
    for spec in specs:
        req = plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec))

        def apply(
            s: plan_pb2_grpc.PlanServiceStub,
            md: Any,
            r: plan_pb2.ApplyDeploymentRequest = req,
        ) -> plan_pb2.Deployment:
            reply: plan_pb2.Deployment = s.ApplyDeployment(r, metadata=md)
            return reply

        d = call(args, apply)
        if args.output == "table":
            emit(f"deployment/{d.spec.name} applied (generation {d.generation})")
        docs.append(d)
    if args.output != "table":
        _emit_deployments(docs, args.output, single=len(docs) == 1)
    return 0


def _emit_deployments(ds: list[Any], output: str, *, single: bool) -> None:
    """``-o json|yaml``: one ModelDeployment, or a ``List`` of them; ``-o name``."""
    names = [f"deployment/{d.spec.name}" for d in ds]
    docs = [deployment_document(d) for d in ds]
    doc: Any = docs[0] if single else {"apiVersion": "v1", "kind": "List", "items": docs}
    emit_document(doc, output, names)


def _assigned(st: Any) -> str:
    """The fleet scheduler's nodes of a deployment (``-`` when none or the scheduler is off)."""
    if not st.assigned_nodes:
        return "-"
    return clip(f"{st.assigned_gpus} GPUs on {','.join(st.assigned_nodes)}", 60)


def cmd_deploy_get(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    from controlplane.wire.plans import DEPLOYMENT_PHASE_NAMES

    if args.name:
        ds = [
            call(
                args,
                lambda s, md: s.GetDeployment(
                    plan_pb2.GetDeploymentRequest(name=args.name), metadata=md
                ),
            )
        ]
    else:
        reply = call(
            args, lambda s, md: s.ListDeployments(plan_pb2.ListDeploymentsRequest(), metadata=md)
        )
        ds = list(reply.deployments)
    if args.output != "table":
        _emit_deployments(ds, args.output, single=bool(args.name))
        return 0
    rows = []
    for d in ds:
        st = d.status
        rows.append(
            [
                d.spec.name,
                d.spec.model or "(config)",
                d.spec.policy,
                d.spec.form,
                DEPLOYMENT_PHASE_NAMES.get(st.phase, "?"),
                st.committed_version or "-",
                st.latest_version or "-",
                ms(st.step_time_us),
                f"{st.cost_per_million_tokens_usd:.3f}" if st.cost_per_million_tokens_usd else "-",
                len(st.nodes) or "-",
                _assigned(st),
                st.instance_of or "-",
                st.instance_count or "-",
                clip(st.message, 60),
            ]
        )
    conditions = [(d.spec.name, c) for d in ds for c in d.status.conditions]
    print(
        table(
            [
                "NAME",
                "MODEL",
                "POLICY",
                "FORM",
                "PHASE",
                "COMMITTED",
                "LATEST",
                "STEP_MS",
                "USD_PER_MTOK",
                "NODES",
                "ASSIGNED",
                "SERVES",
                "INSTANCES",
                "MESSAGE",
            ],
            rows,
        )
    )
    for name, condition in conditions:  # e.g. a store row quarantined
        print(f"condition: {name}: {condition}")
    if args.name:
        _print_instances(ds[0].status)
        _print_demand(ds[0].status)
    return 0


def _ms(v: float) -> str:
    return f"{v:.1f}" if v else "-"


def _instance_state(i: engine_pb2.Instance) -> str:
    """``draining``, ``retiring`` (a newer plan dropped it; it serves until its replacements
    are committed), ``ready`` or ``pending`` (nothing committed yet)."""
    if i.draining:
        return "draining"
    if i.retiring:
        return "retiring"
    return "ready" if i.ready else "pending"


def _print_instances(st: Any) -> None:
    """A deployment's engine instances, one row each."""
    if not st.instances:
        return
    rows = [
        [
            i.name,
            i.role,
            i.pool or "-",
            clip(",".join(i.nodes), 40) or "-",
            i.url or "-",
            i.version or "-",
            _instance_state(i),
            f"{i.requests_per_s:.3g}" if i.requests_per_s else "-",
            i.batch_limit or "-",
            _ms(i.ttft_ms),
            _ms(i.tpot_ms),
        ]
        for i in st.instances
    ]
    print()
    print(
        table(
            [
                "INSTANCE",
                "ROLE",
                "POOL",
                "NODES",
                "URL",
                "VERSION",
                "STATE",
                "REQ_PER_S",
                "BATCH",
                "TTFT_MS",
                "TPOT_MS",
            ],
            rows,
        )
    )


def _print_demand(st: Any) -> None:
    """Planned vs measured demand: rates, lengths, latencies against the predictions."""
    if not st.HasField("demand"):
        return
    d = st.demand
    has_plan, has_measure = d.HasField("planned"), d.HasField("measured")

    def cells(f: Any, present: bool) -> list[str]:
        if not present:
            return ["-"] * 5
        return [
            f"{f.requests_per_s:.3g}",
            f"{f.input_tokens_mean:.0f}",
            f"{f.input_tokens_p90:.0f}",
            f"{f.output_tokens_mean:.0f}",
            f"{f.output_tokens_p90:.0f}",
        ]

    measured = d.measured if has_measure else None
    planned_from = "measured" if d.planned_from_measurement else "spec"
    rows = [
        [
            f"planned ({planned_from})",
            *cells(d.planned, has_plan),
            _ms(d.predicted_ttft_ms),
            _ms(d.predicted_tpot_ms),
            f"{d.slo_percentile:g}%" if d.slo_percentile > 0 else "-",
        ],
        [
            f"measured ({d.measured_seconds:.0f} s, {d.reporters} routers)"
            if has_measure
            else "measured",
            *cells(d.measured, has_measure),
            _ms(measured.ttft_ms_p99) if measured is not None else "-",
            _ms(measured.tpot_ms_p99) if measured is not None else "-",
            _attainment(measured),
        ],
    ]
    print()
    print(
        table(
            [
                "DEMAND",
                "REQ_PER_S",
                "ISL_MEAN",
                "ISL_P90",
                "OSL_MEAN",
                "OSL_P90",
                "TTFT_MS",
                "TPOT_MS",
                "SLO_MET",
            ],
            rows,
        )
    )
    print("(TTFT/TPOT: planned = the fleet plan's prediction; measured = p99 the routers saw)")
    print(
        "(SLO_MET: planned = the SLO's target percentile; measured = share of the streamed "
        "requests the routers judged that met it)"
    )
    if d.replans:
        print(f"re-planned for measured demand {d.replans} time(s); last: {d.last_replan_reason}")


def _attainment(measured: Any) -> str:
    """Measured SLO attainment as a percentage, or ``-`` when none was judged."""
    if measured is None or not measured.HasField("slo_attainment"):
        return "-"
    return f"{100 * measured.slo_attainment:.1f}%"


def cmd_deploy_delete(args: argparse.Namespace) -> int:
    from mixfleet.v1 import plan_pb2

    reply = call(
        args,
        lambda s, md: s.DeleteDeployment(
            plan_pb2.DeleteDeploymentRequest(name=args.name), metadata=md
        ),
    )
    if args.output != "table":
        emit_document(
            {"name": args.name, "deleted": reply.deleted}, args.output, [f"deployment/{args.name}"]
        )
    else:
        print(f"deployment/{args.name} {'deleted' if reply.deleted else 'not found'}")
    return 0 if reply.deleted else 1


def register(groups: Groups) -> None:
    """Add the ``deploy`` group."""
    deploy = add_group(groups, "deploy", "model deployments", required=False)
    p = add_client(deploy, "apply", cmd_deploy_apply, "create or update deployments from YAML")
    p.add_argument("-f", "--file", required=True, metavar="FILE", help="YAML file ('-' = stdin)")
    p = add_client(deploy, "get", cmd_deploy_get, "list deployments or show one")
    p.add_argument("name", nargs="?", metavar="NAME")
    p = add_client(deploy, "delete", cmd_deploy_delete, "delete a deployment")
    p.add_argument("name", metavar="NAME")
