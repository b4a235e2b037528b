"""``mixfleetctl deploy apply|get|delete``: model deployments held by the controller.

``apply -f FILE`` sends every deployment document of a YAML file (``-`` = stdin); ``get``
lists them with their rollout phase and predicted figures, or shows one; ``delete`` removes
one (exit 1 when it does not exist).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from mixfleet.v1 import plan_pb2, plan_pb2_grpc

from apis.documents import load_yaml, read_limited
from apis.wire.deployment import spec_to_proto
from controlplane.cli.connection import add_client, call, ms, to_json
from controlplane.cli.output import Groups, add_group, print_json, table
from controlplane.wire.plans import DEPLOYMENT_PHASE_NAMES
from policies.errors import InputError
from policies.limits import MAX_DOCUMENTS_PER_FILE, decode_utf8
from policies.spec import parse_deployment


def _read_docs(path: str) -> Iterator[Any]:
    """The deployment documents of a YAML file (``-`` = stdin), within the limits of
    :mod:`policies.limits` (size, UTF-8, nesting, no aliases, at most
    :data:`~policies.limits.MAX_DOCUMENTS_PER_FILE` documents)."""
    where = "deployments on stdin" if path == "-" else f"deployment file {path!r}"
    try:
        text = decode_utf8(read_limited(path, "deployment", "deployment"), where)
        yield from load_yaml(text, where, max_documents=MAX_DOCUMENTS_PER_FILE)
    except InputError as exc:
        raise InputError(str(exc), field="-f") from exc


def cmd_deploy_apply(args: argparse.Namespace) -> int:
    specs = [parse_deployment(doc) for doc in _read_docs(args.file)]
    if not specs:
        raise InputError(f"{args.file} holds no deployment", field="-f")
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
        if args.output == "json":
            print_json(to_json(d))
        else:
            print(f"deployment/{d.spec.name} applied (generation {d.generation})")
    return 0


def cmd_deploy_get(args: argparse.Namespace) -> int:
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
    if args.output == "json":
        docs = [to_json(d) for d in ds]
        print_json(docs[0] if args.name else docs)
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
                st.message[:60],
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
                "MESSAGE",
            ],
            rows,
        )
    )
    for name, condition in conditions:  # e.g. a store row quarantined
        print(f"condition: {name}: {condition}")
    return 0


def cmd_deploy_delete(args: argparse.Namespace) -> int:
    reply = call(
        args,
        lambda s, md: s.DeleteDeployment(
            plan_pb2.DeleteDeploymentRequest(name=args.name), metadata=md
        ),
    )
    if args.output == "json":
        print_json({"name": args.name, "deleted": reply.deleted})
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
