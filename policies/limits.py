"""What mixfleet accepts from a user's file or a caller's message: sizes, nesting, counts and
numbers, in one table.

Each limit is checked before the work it protects, so that a refusal costs next to nothing:

* a file's size before it is read (:func:`check_size`), its encoding as it is decoded
  (:func:`decode_utf8`, the message gives the byte offset), its nesting before it is parsed
  (:func:`json_depth`; the YAML loader of :mod:`apis.documents` counts nesting while it
  parses and refuses aliases);
* counts before anything is expanded: GPUs per node and per fleet before a fleet becomes
  per-GPU objects, layers and experts before a model's tables are built;
* numbers against what the model and the wire can hold (:func:`bounded_int`): every
  integer fits int64, counts and sizes fit int32.

Every refusal is an :class:`~policies.errors.InputError` naming the field and the limit (the
CLI prints it as ``error:`` and exits 2; the controller answers INVALID_ARGUMENT).

The values (and why) are listed in docs/security.md.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from policies.errors import InputError

MIB = 1 << 20

#: Largest file (or message field) accepted per kind of document, bytes. A fleet of 2,000
#: nodes written out node by node is about 0.5 MiB; an SGLang expert-distribution dump of
#: 100 steps of DeepSeek-V3 about 10 MiB; a plan of a 2,000-GPU fleet about 20 MiB.
MAX_DOCUMENT_BYTES: Mapping[str, int] = {
    "fleet": 2 * MIB,
    "model config": 1 * MIB,
    "load": 32 * MIB,
    "plan": 64 * MIB,
    "deployment": 2 * MIB,
    "token file": 1 * MIB,
    "price": 1 * MIB,
    "client config": 1 * MIB,
}
#: Largest YAML text, bytes, whatever its kind: YAML is built in Python at about 3 MB/s
#: (JSON in C at about 100 MB/s), so larger documents must be JSON.
MAX_YAML_BYTES = 8 * MIB
#: Deepest nesting of lists and mappings in a user document (the deepest real document, a
#: fleet or a SGLang dump, nests 6 levels).
MAX_NESTING_DEPTH = 64
#: Most YAML documents in one file (``mixfleetctl deploy apply -f``).
MAX_DOCUMENTS_PER_FILE = 100

#: GPUs of one node (a fleet file's ``count``, an agent's inventory).
MAX_GPUS_PER_NODE = 4096
#: NICs of one node (a fleet file's NIC ``count``).
MAX_NICS_PER_NODE = 1024
#: Nodes of one fleet (a fleet file, Solve's ``fleet_json``).
MAX_FLEET_NODES = 16_384
#: GPUs of one fleet, summed over its nodes, checked before the fleet is expanded.
MAX_FLEET_GPUS = 65_536
#: Decoder layers of a model (DeepSeek-V3 has 61).
MAX_LAYERS = 1024
#: Routed experts per MoE layer, experts per token, shared and redundant experts.
MAX_EXPERTS = 4096
#: MoE layers x routed experts (DeepSeek-V3: 58 x 256 = 14,848): bounds the tables a
#: solver builds per (layer, expert).
MAX_LAYER_EXPERTS = 1 << 17
#: Any other integer of a model config (hidden size, heads, vocabulary, FFN widths).
MAX_MODEL_DIMENSION = 1 << 24
#: Tokens per step per GPU of a workload (int32 on the wire).
MAX_TOKENS_PER_GPU = 1 << 20
#: Context length of a workload, tokens (int32 on the wire).
MAX_CONTEXT_TOKENS = 1 << 24
#: Timeouts, intervals and solver time limits, seconds (7 days).
MAX_DURATION_S = 7 * 86_400.0
#: Plan versions and other counters the store keeps (SQLite INTEGER is int64).
MAX_VERSION = (1 << 63) - 1
#: Any integer in a user document (int64, the widest integer on the wire).
MAX_ABS_INTEGER = (1 << 63) - 1
#: Any integer of a user document that travels in a 32-bit wire field (protobuf ``int32``:
#: a deployment's ``minGpus``, ``maxGpus``, ``budget.gpus``); checked where the document is
#: parsed, so the wire encoder never meets a value it cannot hold.
MAX_WIRE_INT32 = (1 << 31) - 1
#: Plausible range of each GPU figure a fleet file or an agent may give, in the unit of the
#: catalog field (:class:`policies.hardware.catalog.GpuSpec`); 0 keeps meaning "none" or "not
#: reported". Beyond them the solvers' coefficients span more than floating point holds (an
#: HBM bandwidth of 1e-300 GB/s made HiGHS fail; a capacity of 0 divided by zero).
GPU_FIGURE_RANGES: Mapping[str, tuple[float, float]] = {
    "sms": (1, 1 << 16),
    "bf16_tflops": (1e-3, 1e6),
    "fp8_tflops": (1e-3, 1e6),
    "fp4_tflops": (1e-3, 1e6),
    "hbm_bandwidth_gbytes_per_s": (1.0, 1e6),
    "memory_gib": (0.25, float(1 << 16)),
    "nvlink_bidir_gbytes_per_s": (1.0, 1e6),
    "nvlink_links": (1, 1024),
    "pcie_per_direction_gbytes_per_s": (0.1, 1e5),
    "power_w": (1.0, 1e5),
}
#: Range of a calibrated (measured) rate, TFLOPS or GB/s (a divisor in the cost model).
MEASURED_RATE_RANGE = (1e-3, 1e7)
#: Range of a calibrated (measured) time, us (a fitted overhead may be next to 0).
MEASURED_TIME_US_RANGE = (1e-12, 1e9)


def measured_range(key: str) -> tuple[float, float]:
    """The range of the measured figure ``key``: a time when its unit is us, else a rate."""
    return MEASURED_TIME_US_RANGE if "_us" in key else MEASURED_RATE_RANGE


#: Range of a NIC's rate per direction, Gbit/s (0 = link down).
NIC_GBITS_RANGE = (1e-3, 1e7)


def check_figure(value: float, low: float, high: float, path: str, *, zero: bool = True) -> None:
    """Refuse a figure outside ``[low, high]`` (0 passes when ``zero``).

    Raises:
        InputError: naming the range.
    """
    if (zero and value == 0) or low <= value <= high:
        return
    raise InputError(
        f"must be {'0 or ' if zero else ''}from {low:g} to {high:g}, got {value!r}", field=path
    )


def check_reported_gpu(
    memory_bytes: int, hbm_gbytes_per_s: float, sms: int, power_w: float, path: str
) -> None:
    """The figures an agent reports for a GPU (0 = not reported) within
    :data:`GPU_FIGURE_RANGES`.

    Raises:
        InputError: naming the field under ``path``.
    """
    r = GPU_FIGURE_RANGES
    check_figure(memory_bytes / 2**30, *r["memory_gib"], f"{path}.memory_bytes (GiB)")
    hbm = "hbm_bandwidth_gbytes_per_s"
    check_figure(hbm_gbytes_per_s, *r[hbm], f"{path}.{hbm}")
    check_figure(sms, *r["sms"], f"{path}.sms")
    check_figure(power_w, *r["power_w"], f"{path}.power_limit_w")


#: Largest gRPC request the controller accepts, and the largest reply it sends, bytes.
MAX_REQUEST_BYTES = 16 * MIB
MAX_REPLY_BYTES = 64 * MIB


def mib(n: int) -> str:
    """``n`` bytes in MiB for messages (``4 MiB``, ``0.25 MiB``)."""
    return f"{n / MIB:g} MiB"


def check_size(size_bytes: int, kind: str, where: str, *, field: str = "") -> None:
    """Refuse a document larger than the limit of its kind.

    Args:
        size_bytes: the document's size, bytes.
        kind: a key of :data:`MAX_DOCUMENT_BYTES`.
        where: the document, for the message (``fleet file 'a.yaml'``, ``fleet_json``).
        field: the field to name (a message field); empty for a file.

    Raises:
        InputError: the document is too large, with the limit.
    """
    limit = MAX_DOCUMENT_BYTES[kind]
    if size_bytes > limit:
        raise InputError(
            f"{where} is {size_bytes:,} bytes, over the {mib(limit)} limit for a {kind}. "
            f"To fix: give a smaller {kind} (split it, or drop what the planner does not read)",
            field=field,
        )


def decode_utf8(data: bytes, where: str, *, field: str = "") -> str:
    """``data`` decoded as UTF-8 (a leading byte-order mark is dropped).

    Raises:
        InputError: not UTF-8, naming the byte offset of the first bad byte.
    """
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 4].hex(" ")
        raise InputError(
            f"{where} is not UTF-8 text: byte {exc.start} (0x{bad}) {exc.reason}. To fix: "
            "save it as UTF-8 (a binary or UTF-16 file is not a YAML or JSON document)",
            field=field,
        ) from exc


# After escaped backslashes and quotes are dropped, a JSON string is '"' ... '"'.
_JSON_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_EMPTY_PAIR = re.compile(r"\[\]|\{\}")


def json_depth(text: str, limit: int = MAX_NESTING_DEPTH) -> int:
    """Bracket nesting of a JSON text, read without parsing it (brackets in strings skipped),
    up to ``limit + 1``: a result over ``limit`` means "deeper than the limit".

    Cost: a few passes of C string operations and regular expressions (one pass per level,
    about 0.1 s per level for 10 MB), no Python step per character.
    """
    bare = text.replace("\\\\", "").replace('\\"', "")
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", bare))
    depth = 0
    while brackets and depth <= limit:
        brackets, removed = _EMPTY_PAIR.subn("", brackets)
        if not removed:  # unbalanced: the parser will say where
            break
        depth += 1
    return depth


def depth_error(where: str, depth: int | str, *, field: str = "") -> InputError:
    """The refusal of a document nested deeper than :data:`MAX_NESTING_DEPTH`."""
    return InputError(
        f"{where} nests lists and mappings {depth} levels deep, over the limit of "
        f"{MAX_NESTING_DEPTH}. To fix: flatten it (no real fleet, model, load or plan "
        "document nests that deep)",
        field=field,
    )


def bounded_int(value: Any, path: str, *, minimum: int = 1, maximum: int) -> int:
    """``value`` as an integer in ``[minimum, maximum]``.

    Raises:
        InputError: not an integer (booleans are not), or out of range, naming both bounds.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"must be an integer, got {value!r}", field=path)
    if value < minimum or value > maximum:
        shown = f"{value:,}" if abs(value) < 10**30 else f"{value:.3e}"
        raise InputError(
            f"must be an integer from {minimum:,} to {maximum:,}, got {shown}", field=path
        )
    return value


#: A node name an agent may register: a host name (letters, digits, '.', '_', '-', at most
#: 253 characters, starting and ending with a letter or digit).
_NODE_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


def check_node_name(name: str, path: str) -> None:
    """Refuse a node name that is not a host name (it is shown in logs, tables and labels).

    Raises:
        InputError: naming the rule.
    """
    if not _NODE_NAME.match(name):
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise InputError(
            f"{shown!r} is not a host name. To fix: use letters, digits, '.', '_' and '-' "
            "(at most 253 characters, starting and ending with a letter or digit)",
            field=path,
        )


_HOST_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
MAX_HOST_CHARS = 253
"""Longest host name, characters (RFC 1123)."""


def check_host_address(address: str, path: str) -> None:
    """Refuse what is neither an IP literal (IPv4, or IPv6 without brackets) nor a host name
    (RFC 1123: dot-separated labels of letters, digits and '-', each 1-63 characters, not
    starting or ending with '-'; at most 253 characters).

    Raises:
        InputError: naming ``path`` and the rule.
    """
    try:
        ipaddress.ip_address(address)
        return
    except ValueError:
        pass
    labels = address.split(".")
    if len(address) <= MAX_HOST_CHARS and all(_HOST_LABEL.match(label) for label in labels):
        return
    shown = address if len(address) <= 40 else address[:40] + "..."
    raise InputError(
        f"{shown!r} is neither an IP address nor a host name. To fix: give an IPv4 or IPv6 "
        "address (no brackets, no port) or a host name of letters, digits, '-' and '.' "
        f"(labels of at most 63 characters, at most {MAX_HOST_CHARS} in all)",
        field=path,
    )


_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def key_path(path: str, key: object) -> str:
    """The field path of ``key`` under ``path``: ``path.key`` for a plain key, else
    ``path['the key']`` (quoted, so that a key like ``%s`` or ``a.b`` cannot be misread;
    at most 40 characters of it)."""
    text = str(key)
    if _PLAIN_KEY.match(text) and len(text) <= 64:
        return f"{path}.{text}" if path else text
    shown = text if len(text) <= 40 else text[:40] + "..."
    return f"{path}[{shown!r}]"
