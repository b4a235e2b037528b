"""A small evaluator for the subset of CEL that mixfleet's CRD validation rules use.

The fake API server (:mod:`support.fakeapi`) and the example checks evaluate the
``x-kubernetes-validations`` rules of the generated CRDs with it, so a rule that the real API
server would enforce is enforced in tests too. Anything outside the subset raises
:class:`CelError` at parse time - an unsupported rule fails loudly instead of being skipped.

Supported: ``self`` and ``oldSelf``; field selection ``a.b``; indexing ``a[i]``,
``a['k']``; literals (int, float, single- or double-quoted string, true, false, null,
lists ``[...]``); operators ``! - * / % + - < <= > >= == != in && || ?:``;
``has(a.b)``; ``size(x)`` and ``x.size()``; string ``startsWith``, ``endsWith``,
``contains``, ``matches``; list macros ``all(v, pred)`` and ``exists(v, pred)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class CelError(Exception):
    """A rule outside the supported subset, or an evaluation error (no such key...)."""


_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+\.\d+|\d+)|(?P<str>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>==|!=|<=|>=|&&|\|\||[-+*/%<>!?:.,()\[\]]))"
)


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str


def _tokens(src: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    src = src.rstrip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise CelError(f"cannot parse CEL at {src[pos:]!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        out.append(_Tok(kind, m.group(kind)))
    out.append(_Tok("end", ""))
    return out


Node = tuple[Any, ...]


class _Parser:
    def __init__(self, src: str) -> None:
        self.toks = _tokens(src)
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self, text: str | None = None) -> _Tok:
        t = self.toks[self.i]
        if text is not None and t.text != text:
            raise CelError(f"expected {text!r}, got {t.text!r}")
        self.i += 1
        return t

    def parse(self) -> Node:
        node = self.cond()
        if self.peek().kind != "end":
            raise CelError(f"unexpected {self.peek().text!r}")
        return node

    def cond(self) -> Node:
        c = self.binary(0)
        if self.peek().text == "?":
            self.take("?")
            a = self.cond()
            self.take(":")
            b = self.cond()
            return ("?", c, a, b)
        return c

    _LEVELS = (
        ("||",),
        ("&&",),
        ("==", "!=", "<", "<=", ">", ">=", "in"),
        ("+", "-"),
        ("*", "/", "%"),
    )

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek().text in self._LEVELS[level]:
            op = self.take().text
            right = self.binary(level + 1)
            left = ("bin", op, left, right)
        return left

    def unary(self) -> Node:
        if self.peek().text in ("!", "-"):
            op = self.take().text
            return ("un", op, self.unary())
        return self.postfix(self.primary())

    def args(self) -> list[Node]:
        self.take("(")
        out: list[Node] = []
        while self.peek().text != ")":
            out.append(self.cond())
            if self.peek().text == ",":
                self.take(",")
        self.take(")")
        return out

    def postfix(self, node: Node) -> Node:
        while True:
            t = self.peek()
            if t.text == ".":
                self.take(".")
                name = self.take().text
                if self.peek().text == "(":
                    node = ("call", name, node, self.args())
                else:
                    node = ("sel", node, name)
            elif t.text == "[":
                self.take("[")
                idx = self.cond()
                self.take("]")
                node = ("idx", node, idx)
            else:
                return node

    def primary(self) -> Node:
        t = self.take()
        if t.kind == "num":
            return ("lit", float(t.text) if "." in t.text else int(t.text))
        if t.kind == "str":
            body = t.text[1:-1]
            return ("lit", re.sub(r"\\(.)", r"\1", body))
        if t.text == "(":
            node = self.cond()
            self.take(")")
            return node
        if t.text == "[":
            items: list[Node] = []
            while self.peek().text != "]":
                items.append(self.cond())
                if self.peek().text == ",":
                    self.take(",")
            self.take("]")
            return ("list", items)
        if t.kind == "id":
            if t.text in ("true", "false"):
                return ("lit", t.text == "true")
            if t.text == "null":
                return ("lit", None)
            if self.peek().text == "(":
                return ("call", t.text, None, self.args())
            return ("var", t.text)
        raise CelError(f"unexpected {t.text!r}")


_FUNCS = {"has", "size", "startsWith", "endsWith", "contains", "matches", "all", "exists"}


def _check(node: Node) -> None:
    if node[0] == "call":
        if node[1] not in _FUNCS:
            raise CelError(f"function {node[1]!r} is outside the supported CEL subset")
        if node[1] == "has" and (len(node[3]) != 1 or node[3][0][0] != "sel"):
            raise CelError("has() takes one field selection, e.g. has(self.preset)")
    for child in node[1:]:
        if isinstance(child, tuple):
            _check(child)
        elif isinstance(child, list):
            for c in child:
                _check(c)


def compile_rule(rule: str) -> Node:
    """Parse a rule; raises :class:`CelError` for anything outside the subset."""
    node = _Parser(rule).parse()
    _check(node)
    return node


def uses_old_self(rule: str) -> bool:
    """A transition rule (checked on update only)."""
    return re.search(r"\boldSelf\b", rule) is not None


def _eval(node: Node, env: Mapping[str, Any]) -> Any:
    op = node[0]
    if op == "lit":
        return node[1]
    if op == "var":
        if node[1] not in env:
            raise CelError(f"undeclared reference {node[1]!r}")
        return env[node[1]]
    if op == "list":
        return [_eval(n, env) for n in node[1]]
    if op == "sel":
        obj = _eval(node[1], env)
        if not isinstance(obj, Mapping):
            raise CelError(f"cannot select {node[2]!r} from {type(obj).__name__}")
        if node[2] not in obj:
            raise CelError(f"no such key: {node[2]}")
        return obj[node[2]]
    if op == "idx":
        obj = _eval(node[1], env)
        key = _eval(node[2], env)
        try:
            return obj[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise CelError(f"no such key or index: {key!r}") from exc
    if op == "un":
        v = _eval(node[2], env)
        return (not _bool(v)) if node[1] == "!" else -v
    if op == "?":
        return _eval(node[2], env) if _bool(_eval(node[1], env)) else _eval(node[3], env)
    if op == "bin":
        return _binary(node[1], node[2], node[3], env)
    if op == "call":
        return _call(node, env)
    raise CelError(f"bad node {op!r}")


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise CelError(f"expected a bool, got {v!r}")
    return v


def _binary(op: str, a_node: Node, b_node: Node, env: Mapping[str, Any]) -> Any:
    if op == "&&":
        return _bool(_eval(a_node, env)) and _bool(_eval(b_node, env))
    if op == "||":
        return _bool(_eval(a_node, env)) or _bool(_eval(b_node, env))
    a, b = _eval(a_node, env), _eval(b_node, env)
    if op == "==":
        return bool(a == b)
    if op == "!=":
        return bool(a != b)
    if op == "in":
        return a in b
    try:
        if op == "<":
            return a < b
        if op == "<=":
            return a <= b
        if op == ">":
            return a > b
        if op == ">=":
            return a >= b
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a // b if isinstance(a, int) and isinstance(b, int) else a / b
        if op == "%":
            return a % b
    except (TypeError, ZeroDivisionError) as exc:
        raise CelError(f"{op}: {exc}") from exc
    raise CelError(f"unknown operator {op!r}")


def _call(node: Node, env: Mapping[str, Any]) -> Any:
    name, target, args = node[1], node[2], node[3]
    if name == "has":
        sel = args[0]
        obj = _eval(sel[1], env)
        return isinstance(obj, Mapping) and sel[2] in obj
    if name in ("all", "exists"):
        if target is None or len(args) != 2 or args[0][0] != "var":
            raise CelError(f"{name} takes a variable and a predicate: list.{name}(x, pred)")
        items = _eval(target, env)
        var = args[0][1]
        results = (_bool(_eval(args[1], {**env, var: x})) for x in items)
        return all(results) if name == "all" else any(results)
    values = [_eval(a, env) for a in args]
    if target is not None:
        values.insert(0, _eval(target, env))
    if name == "size":
        if len(values) != 1:
            raise CelError("size takes one argument")
        return len(values[0])
    if len(values) != 2 or not all(isinstance(v, str) for v in values):
        raise CelError(f"{name} takes a string receiver and one string argument")
    s, x = values
    if name == "startsWith":
        return s.startswith(x)
    if name == "endsWith":
        return s.endswith(x)
    if name == "contains":
        return x in s
    return re.search(x, s) is not None


def evaluate(rule: str | Node, self_value: Any, old_self: Any = None) -> bool:
    """Evaluate a rule; True when the value passes.

    Raises:
        CelError: evaluation error (the API server rejects the object in that case too).
    """
    node = compile_rule(rule) if isinstance(rule, str) else rule
    env: dict[str, Any] = {"self": self_value}
    if old_self is not None:
        env["oldSelf"] = old_self
    return _bool(_eval(node, env))
