"""``mixfleetctl certs init DIR``: a development CA, certificates and a token file.

For trying mutual TLS locally; the files and the flags that use them are printed.
"""

from __future__ import annotations

import argparse

from controlplane.cli.output import Groups, add_group, add_leaf, add_output_arg, emit_document


def cmd_certs_init(args: argparse.Namespace) -> int:
    from controlplane.server.certs import init_dev_pki

    out = init_dev_pki(args.dir, sans=args.san or (), force=args.force)
    if args.output != "table":
        names = sorted(p.name for p in out.iterdir())
        doc = {"dir": str(out), "files": names}
        emit_document(doc, args.output, [f"file/{out / n}" for n in names])
        return 0
    print(f"wrote a development CA, certificates and tokens to {out}")
    print(
        "  controller: --tls-cert server.pem --tls-key server-key.pem --tls-ca ca.pem "
        "--token-file tokens"
    )
    print("  agents:     --tls-cert agent.pem --tls-key agent-key.pem --tls-ca ca.pem")
    print(
        "  mixfleetctl: --tls-cert admin.pem --tls-key admin-key.pem --tls-ca ca.pem "
        "--token-file tokens"
    )
    return 0


def register(groups: Groups) -> None:
    """Add the ``certs`` group."""
    certs = add_group(groups, "certs", "development certificates for mutual TLS", required=False)
    p = add_leaf(
        certs,
        "init",
        cmd_certs_init,
        "make a CA, server/agent/admin/engine certs and tokens",
        description="Make a development CA, certificates and a token file.",
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument(
        "--san",
        action="append",
        metavar="NAME",
        help="extra DNS name or IP of the controller (repeatable)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing CA in DIR")
    add_output_arg(p)
