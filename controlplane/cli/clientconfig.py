"""The client configuration: named contexts (controller, TLS files, token), like a kubeconfig.

The file is ``$MIXFLEET_CONFIG``, else ``~/.config/mixfleet/config.yaml``
(``$XDG_CONFIG_HOME/mixfleet/config.yaml`` when that is set)::

    apiVersion: mixfleet.io/v1alpha1
    kind: ClientConfig
    currentContext: prod
    contexts:
    - name: prod
      controller: ctl.example.com:7070
      tlsCa: /etc/mixfleet/ca.pem
      tlsCert: /etc/mixfleet/admin.pem
      tlsKey: /etc/mixfleet/admin-key.pem
      tokenFile: /etc/mixfleet/tokens      # or token: <bearer token>
    - name: local
      controller: 127.0.0.1:7070

Every key is checked: an unknown one is refused with its path and the closest known key.
A connection option is taken from, in order: the command-line flag, the environment
(:data:`ENV`), the context named by ``--use-context`` / ``$MIXFLEET_CONTEXT`` / the file's
``currentContext``, the built-in default (``127.0.0.1:7070``, plaintext, no token).

``mixfleetctl config view|use-context|set-context|get-contexts`` read and write the file
(:func:`register`); the file is written with mode 0600 since it may hold a token.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from controlplane.cli.output import Groups, add_group, add_leaf, add_output_arg, emit, emit_document
from controlplane.cli.output import table as format_rows
from policies.errors import InputError

API_VERSION = "mixfleet.io/v1alpha1"
KIND = "ClientConfig"

#: Context key -> the environment variable that overrides it (and the flag's dest).
ENV = {
    "controller": "MIXFLEET_CONTROLLER",
    "tlsCa": "MIXFLEET_TLS_CA",
    "tlsCert": "MIXFLEET_TLS_CERT",
    "tlsKey": "MIXFLEET_TLS_KEY",
    "token": "MIXFLEET_TOKEN",
    "tokenFile": "MIXFLEET_TOKEN_FILE",
}
#: Context key -> the argparse dest of its flag.
DESTS = {
    "controller": "controller",
    "tlsCa": "tls_ca",
    "tlsCert": "tls_cert",
    "tlsKey": "tls_key",
    "token": "token",
    "tokenFile": "token_file",
}
_TOP_KEYS = ("apiVersion", "kind", "currentContext", "contexts")
_CONTEXT_KEYS = ("name", *ENV)


@dataclass(frozen=True)
class Context:
    """One named way to reach a controller. Paths are as written (``~`` expanded on use).

    Attributes:
        name: the context's name.
        settings: key of :data:`ENV` -> value: ``controller`` (``HOST:PORT``), ``tlsCa`` /
            ``tlsCert`` / ``tlsKey`` (PEM files of mutual TLS; no ``tlsCa`` = plaintext),
            ``token`` or ``tokenFile`` (its admin, else viewer, token is sent).
    """

    name: str
    settings: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientConfig:
    """The parsed file: contexts in file order and the current one's name ("" = none)."""

    current: str = ""
    contexts: tuple[Context, ...] = ()

    def context(self, name: str) -> Context:
        """The context ``name``.

        Raises:
            InputError: no such context, naming the known ones.
        """
        for c in self.contexts:
            if c.name == name:
                return c
        known = ", ".join(c.name for c in self.contexts) or "none"
        raise InputError(
            f"no context {name!r} in {config_path()} (contexts: {known}). To fix: "
            f"mixfleetctl config set-context {name} --controller HOST:PORT",
            field="--use-context",
        )


def config_path() -> Path:
    """``$MIXFLEET_CONFIG``, else ``$XDG_CONFIG_HOME/mixfleet/config.yaml``, else
    ``~/.config/mixfleet/config.yaml``."""
    explicit = os.environ.get("MIXFLEET_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mixfleet" / "config.yaml"


def _unknown(key: str, known: tuple[str, ...], path: str) -> InputError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return InputError(
        f"unknown key {key!r}{hint} Known: {', '.join(known)}",
        field=f"{path}.{key}" if path else key,
    )


def parse_config(doc: Any, where: str) -> ClientConfig:
    """Check and read a client configuration document.

    Raises:
        InputError: naming the file and the path of the bad key or value.
    """

    def bad(message: str, path: str) -> InputError:
        return InputError(f"client config {where}: {path}: {message}", field=path)

    if doc is None:
        return ClientConfig()
    if not isinstance(doc, Mapping):
        raise bad("must be a mapping", "(top)")
    for key in doc:
        if key not in _TOP_KEYS:
            raise bad(str(_unknown(str(key), _TOP_KEYS, "")), str(key))
    if doc.get("apiVersion", API_VERSION) != API_VERSION:
        raise bad(f"must be {API_VERSION}", "apiVersion")
    if doc.get("kind", KIND) != KIND:
        raise bad(f"must be {KIND}", "kind")
    raw = doc.get("contexts") or []
    if not isinstance(raw, list):
        raise bad("must be a list of contexts", "contexts")
    contexts: list[Context] = []
    for i, c in enumerate(raw):
        path = f"contexts[{i}]"
        if not isinstance(c, Mapping):
            raise bad("must be a mapping", path)
        for key, value in c.items():
            if key not in _CONTEXT_KEYS:
                raise bad(str(_unknown(str(key), _CONTEXT_KEYS, "")), f"{path}.{key}")
            if not isinstance(value, str) or not value:
                raise bad("must be a non-empty string", f"{path}.{key}")
        if "name" not in c:
            raise bad("missing name", f"{path}.name")
        if any(x.name == c["name"] for x in contexts):
            raise bad(f"context {c['name']!r} appears twice", f"{path}.name")
        contexts.append(Context(c["name"], {k: v for k, v in c.items() if k != "name"}))
    current = doc.get("currentContext", "") or ""
    if not isinstance(current, str):
        raise bad("must be a context name", "currentContext")
    if current and all(x.name != current for x in contexts):
        raise bad(f"names no context ({', '.join(x.name for x in contexts)})", "currentContext")
    return ClientConfig(current, tuple(contexts))


def load_config() -> ClientConfig:
    """The client config file, or an empty config when there is none.

    Raises:
        InputError: an unreadable or invalid file.
    """
    path = config_path()
    if not path.exists():
        return ClientConfig()
    from controlplane.cli.files import read_document

    return parse_config(read_document(path, "client config"), str(path))


def config_to_doc(cfg: ClientConfig, *, redact: bool = False) -> dict[str, Any]:
    """The file's document of ``cfg`` (tokens replaced by ``REDACTED`` with ``redact``)."""
    contexts = []
    for c in cfg.contexts:
        entry: dict[str, Any] = {"name": c.name}
        for k in ENV:
            if k in c.settings:
                entry[k] = "REDACTED" if redact and k == "token" else c.settings[k]
        contexts.append(entry)
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND}
    if cfg.current:
        doc["currentContext"] = cfg.current
    doc["contexts"] = contexts
    return doc


def save_config(cfg: ClientConfig) -> Path:
    """Write ``cfg`` to :func:`config_path` (mode 0600)."""
    from controlplane.cli.files import dump_document

    path = config_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_document(config_to_doc(cfg), "yaml"))
    except OSError as exc:
        raise InputError(
            f"cannot write the client config {path}: {exc.strerror or exc}. To fix: set "
            "MIXFLEET_CONFIG to a writable path"
        ) from exc
    return path


def resolve(args: argparse.Namespace) -> dict[str, str | None]:
    """The connection settings of a command: flag, else environment, else the selected
    context, else None (keys of :data:`ENV`)."""
    out: dict[str, str | None] = {}
    ctx: Context | None = None
    name = getattr(args, "use_context", None) or os.environ.get("MIXFLEET_CONTEXT")
    need_file = name or any(
        getattr(args, DESTS[k], None) is None and not os.environ.get(ENV[k]) for k in ENV
    )
    if need_file:
        cfg = load_config()
        name = name or cfg.current
        if name:
            ctx = cfg.context(name)
    for key, env in ENV.items():
        value = getattr(args, DESTS[key], None) or os.environ.get(env) or None
        if value is None and ctx is not None:
            value = ctx.settings.get(key)
        out[key] = value
    return out


# ------------------------------------------------------------------------ commands


def cmd_config_view(args: argparse.Namespace) -> int:
    """``config view``: the file (tokens redacted unless ``--raw``)."""
    cfg = load_config()
    doc = config_to_doc(cfg, redact=not args.raw)
    if args.output == "table":
        emit(f"# {config_path()}")
        emit_document(doc, "yaml")
    else:
        emit_document(doc, args.output, [f"context/{c.name}" for c in cfg.contexts])
    return 0


def cmd_config_get_contexts(args: argparse.Namespace) -> int:
    """``config get-contexts``: one row per context, ``*`` on the current one."""
    cfg = load_config()
    rows = [
        [
            "*" if c.name == cfg.current else "",
            c.name,
            c.settings.get("controller", "-"),
            "yes" if "tlsCa" in c.settings else "no",
        ]
        for c in cfg.contexts
    ]
    if args.output == "table":
        emit(format_rows(["CURRENT", "NAME", "CONTROLLER", "TLS"], rows))
    else:
        doc = config_to_doc(cfg, redact=True)["contexts"]
        emit_document(doc, args.output, [f"context/{c.name}" for c in cfg.contexts])
    return 0


def cmd_config_use_context(args: argparse.Namespace) -> int:
    """``config use-context NAME``: make NAME the current context."""
    cfg = load_config()
    cfg.context(args.name)  # raises naming the known ones
    path = save_config(replace(cfg, current=args.name))
    _done(args, f"switched to context {args.name!r} ({path})", path)
    return 0


def _done(args: argparse.Namespace, line: str, path: Path) -> None:
    """The result of a change: ``line``, or ``{context, file}`` / ``context/NAME``."""
    if args.output == "table":
        emit(line)
    else:
        doc = {"context": args.name, "file": str(path)}
        emit_document(doc, args.output, [f"context/{args.name}"])


def cmd_config_set_context(args: argparse.Namespace) -> int:
    """``config set-context NAME [--controller ...]``: create or update a context."""
    cfg = load_config()
    given = {k: getattr(args, DESTS[k]) for k in ENV if getattr(args, DESTS[k], None)}
    contexts = list(cfg.contexts)
    for i, c in enumerate(contexts):
        if c.name == args.name:
            contexts[i] = Context(c.name, {**c.settings, **given})
            break
    else:
        contexts.append(Context(args.name, given))
    current = args.name if args.current or not cfg.current else cfg.current
    path = save_config(ClientConfig(current, tuple(contexts)))
    _done(
        args,
        f"context {args.name!r} set in {path}" + (" (current)" if current == args.name else ""),
        path,
    )
    return 0


def register(groups: Groups) -> None:
    """Add the ``config`` group."""
    config = add_group(groups, "config", "client config: contexts (controller, TLS, token)")
    p = add_leaf(config, "view", cmd_config_view, "print the client config file")
    p.add_argument("--raw", action="store_true", help="show tokens instead of REDACTED")
    add_output_arg(p)
    p = add_leaf(config, "get-contexts", cmd_config_get_contexts, "list the contexts")
    add_output_arg(p)
    p = add_leaf(config, "use-context", cmd_config_use_context, "set the current context")
    p.add_argument("name", metavar="NAME")
    add_output_arg(p)
    p = add_leaf(config, "set-context", cmd_config_set_context, "create or update a context")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--controller", metavar="ADDR", help="controller HOST:PORT")
    p.add_argument("--tls-ca", metavar="PEM", help="CA of the controller")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate")
    p.add_argument("--tls-key", metavar="PEM", help="client key")
    p.add_argument("--token", metavar="TOKEN", help="bearer token (stored in the file)")
    p.add_argument("--token-file", metavar="FILE", help="bearer token file")
    p.add_argument("--current", action="store_true", help="also make it the current context")
    add_output_arg(p)
