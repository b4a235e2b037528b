"""HTTP for the fake API server: a request handler that routes each request to a verb of
:class:`support.fakeapi.server.FakeApiServer`, answers errors as ``Status`` documents,
streams watches as chunked JSON lines, and records every request."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

import yaml

from support.fakeapi.errors import ApiStatusError, status_doc
from support.fakeapi.records import RequestRecord
from support.fakeapi.resources import ResourceType
from support.fakeapi.routing import discovery

if TYPE_CHECKING:
    from support.fakeapi.server import FakeApiServer


class ApiHandler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, doc: Any, warnings: Sequence[str] = ()) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for w in warnings:
            self.send_header("Warning", f'299 - "{w}"')
        self.end_headers()
        self.wfile.write(raw)

    def _record(self, status: int) -> None:
        u = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(u.query).items()}
        with self.api._lock:
            self.api.requests.append(
                RequestRecord(
                    self.command, u.path, query, self.headers.get("User-Agent", ""), status
                )
            )

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            try:
                return yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise ApiStatusError(400, "BadRequest", f"cannot decode body: {exc}") from exc

    def _discovery(self, path: str) -> bool:
        """Answer a discovery GET (:func:`support.fakeapi.routing.discovery`); False when
        ``path`` is not one."""
        found = discovery(self.api.types, path) if self.command == "GET" else None
        if found is None:
            return False
        self._record(200)
        self._send(200, found)
        return True

    def _handle(self) -> None:
        u = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(u.query).items()}
        code = 200
        try:
            body = self._body() if self.command in ("POST", "PUT", "PATCH", "DELETE") else None
            fault = self.api.take_fault(self.command, u.path)
            if fault is not None:
                raise ApiStatusError(
                    fault.code, fault.reason, f"injected fault for {self.command} {u.path}"
                )
            if self._discovery(u.path):
                return
            rt, ns, name, sub = self.api.route(u.path)
            manager = (
                query.get("fieldManager") or self.headers.get("User-Agent", "unknown").split("/")[0]
            )
            scope = "status" if sub == "status" else "main"
            warnings: list[str] = []
            if self.command == "GET" and name is None and query.get("watch") in ("true", "1"):
                self._record(200)
                self._stream(rt, ns, query)
                return
            if self.command == "GET":
                doc = (
                    self.api.list_objects(rt, ns, query)
                    if name is None
                    else self.api.get(rt, ns, name)
                )
            elif self.command == "POST" and name is None:
                if not isinstance(body, dict):
                    raise ApiStatusError(400, "BadRequest", "body must be an object")
                doc, warnings = self.api.create(rt, ns, body, manager)
                code = 201
            elif self.command == "PUT" and name is not None:
                if not isinstance(body, dict):
                    raise ApiStatusError(400, "BadRequest", "body must be an object")
                doc, warnings = self.api.update(rt, ns, name, body, manager, scope)
            elif self.command == "PATCH" and name is not None:
                ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                if ctype == "application/apply-patch+yaml":
                    if not isinstance(body, dict):
                        raise ApiStatusError(400, "BadRequest", "apply body must be an object")
                    doc, warnings = self.api.apply(
                        rt,
                        ns,
                        name,
                        body,
                        query.get("fieldManager", ""),
                        query.get("force") == "true",
                        scope,
                    )
                elif ctype == "application/merge-patch+json":
                    doc, warnings = self.api.merge_patch(
                        rt, ns, name, body, manager, scope, json_ops=False
                    )
                elif ctype == "application/json-patch+json":
                    if not isinstance(body, list):
                        raise ApiStatusError(400, "BadRequest", "JSON patch must be a list")
                    doc, warnings = self.api.merge_patch(
                        rt, ns, name, body, manager, scope, json_ops=True
                    )
                else:
                    raise ApiStatusError(
                        415,
                        "UnsupportedMediaType",
                        f"the body of the request was in an unknown format: {ctype}",
                    )
            elif self.command == "DELETE" and name is not None:
                doc = self.api.delete(rt, ns, name, body if isinstance(body, dict) else None)
            else:
                raise ApiStatusError(
                    405, "MethodNotAllowed", f"{self.command} is not supported on {u.path}"
                )
        except ApiStatusError as exc:
            code = exc.code
            doc, warnings = status_doc(exc.code, exc.reason, exc.message, exc.causes), []
        self._record(code)
        self._send(code, doc, warnings)

    def _stream(self, rt: ResourceType, ns: str, query: Mapping[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        ok = True

        def alive() -> bool:
            return ok and not self.api._closing

        try:
            for ev in self.api.watch_events(rt, ns, query, alive):
                line = json.dumps(ev).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            ok = False
        self.close_connection = True

    do_GET = _handle  # noqa: N815 - BaseHTTPRequestHandler's method names
    do_POST = _handle  # noqa: N815
    do_PUT = _handle  # noqa: N815
    do_PATCH = _handle  # noqa: N815
    do_DELETE = _handle  # noqa: N815
