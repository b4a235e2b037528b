"""What the router reads from a request and writes into it: the tier, the work estimate,
and the engine's per-request DP rank field.

Where each engine reads the rank (read from the engines' own source):

* SGLang 0.5.23: body field ``routed_dp_rank`` on ``/generate``
  (``GenerateReqInput.routed_dp_rank``, ``python/sglang/srt/managers/io_struct.py``) and on
  the OpenAI endpoints (``CompletionRequest`` / ``ChatCompletionRequest.routed_dp_rank``,
  ``srt/entrypoints/openai/protocol.py``); the data-parallel controller sends a request with
  it to that rank (``srt/managers/data_parallel_controller.py``, ``if req.routed_dp_rank is
  not None``). The old name ``data_parallel_rank`` is a deprecated alias.
* vLLM 0.33.0: header ``X-data-parallel-rank`` only
  (``OpenAIServing._get_data_parallel_rank``, ``vllm/entrypoints/generate/base/serving.py``,
  read by the chat and completion servers); there is no body field.
* TensorRT-LLM (main, ``tensorrt_llm/serve/openai_protocol.py`` at commit 0076e939, late
  2026): trtllm-serve has no per-request rank field. ``CompletionRequest`` and
  ``ChatCompletionRequest`` are ``OpenAIBaseModel`` (``extra="forbid"``) without
  ``attention_dp_rank`` / ``attention_dp_relax``, so a body carrying them is refused with
  400 ``{"error": ...}`` (``validation_exception_handler``, ``serve/openai_server.py``), and
  the server builds ``SchedulingParams(agent_hierarchy=...)`` without a rank. Only the LLM
  API takes ``SchedulingParams(attention_dp_rank=r, attention_dp_relax=False)``
  (``tensorrt_llm/scheduling_params.py``). The router therefore writes no rank for
  ``trtllm``: inside one trtllm-serve its ``DefaultADPRouter`` balances the ranks; the plan
  is imposed across instances (``share=``).
* native (mixfleet's reference runtime): header ``X-data-parallel-rank``, as vLLM.

Work estimate: prompt tokens plus expected output tokens (``max_tokens``,
``max_completion_tokens`` or SGLang's ``sampling_params.max_new_tokens``, else the
configured default). An output limit must be an integer from 0 to ``--max-output-tokens``
(a larger one would hold its rank's stride pass ahead of every other rank's until the
weights change: the rank would get no traffic). A body is refused before it is parsed when
its JSON nests deeper than ``--max-json-depth`` (:func:`parse_body`). Prompt tokens come
from the model's tokenizer when one is configured, else the estimate
``ceil(characters / 4)``; token-id prompts count exactly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Container, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from controlplane.router.settings import MAX_OUTPUT_TOKENS
from policies.errors import InputError

#: The header of the rank for vLLM and the native runtime.
RANK_HEADER = "X-data-parallel-rank"
#: Header that names the tier of a request.
TIER_HEADER = "X-Mixfleet-Tier"
#: Header that names a priority class (mapped to a tier by the settings).
PRIORITY_HEADER = "X-Priority-Class"

#: Counts the tokens of a text.
TokenCounter = Callable[[str], int]


def chars_estimate(text: str) -> int:
    """Tokens of ``text`` estimated as ``ceil(characters / 4)`` (no tokenizer installed)."""
    return math.ceil(len(text) / 4)


def load_tokenizer(name: str) -> TokenCounter:
    """A token counter from a Hugging Face tokenizer (name or path).

    Raises:
        InputError: ``transformers`` is not installed or the tokenizer cannot be loaded.
    """
    try:
        from transformers import AutoTokenizer  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise InputError(
            "needs the transformers package. To fix: pip install transformers, or leave "
            "--tokenizer out (the router then estimates tokens as characters / 4)",
            field="--tokenizer",
        ) from exc
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise InputError(f"cannot load tokenizer {name!r}: {exc}", field="--tokenizer") from exc

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    return count


@dataclass(frozen=True)
class Work:
    """Estimated tokens of one request.

    Attributes:
        prompt_tokens: prompt tokens (tokenizer count or estimate).
        output_tokens: expected output tokens.
        stream: the client asked for a streamed answer.
    """

    prompt_tokens: int
    output_tokens: int
    stream: bool

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def _text_of(value: Any) -> tuple[str, int]:
    """(text, exact token count) of a prompt value: text, list of texts, token ids, lists
    of token ids, or chat content parts."""
    if isinstance(value, str):
        return value, 0
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return "", len(value)
        texts, ids = zip(*(_text_of(v) for v in value), strict=True) if value else ((), ())
        return "".join(texts), sum(ids)
    if isinstance(value, dict):
        return _text_of(value.get("text", value.get("content", "")))
    return "", 0


def _output_tokens(value: Any, field: str, default: int, cap: int) -> int:
    """The expected output of a request from its limit field ``value`` (None: not set).

    Raises:
        InputError: not an integer (JSON ``10.0`` counts as one), or outside 0..``cap``.
    """
    if value is None:
        return default
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise InputError(f"must be an integer, got {_show(value)}", field=field)
    if not 0 <= value <= cap:
        raise InputError(
            f"must be between 0 and {cap} (the router's --max-output-tokens), got {_show(value)}",
            field=field,
        )
    return int(value)


def _show(value: Any) -> str:
    """A client's value for an error message, at most 40 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def estimate_work(
    path: str,
    body: Mapping[str, Any],
    count: TokenCounter,
    default_output_tokens: int,
    max_output_tokens: int = MAX_OUTPUT_TOKENS,
) -> Work:
    """The work of a request to ``path`` (``/v1/chat/completions``, ``/v1/completions``,
    ``/generate``) with JSON ``body``.

    Raises:
        InputError: an output limit (``max_tokens``, ``max_completion_tokens``,
            ``sampling_params.max_new_tokens``) that is not an integer in
            0..``max_output_tokens``; the message names the field. A chat request's
            ``max_tokens`` is checked beside its ``max_completion_tokens``: the engines fall
            back to it (vLLM when the other is null, SGLang also when it is 0).
    """
    unset = default_output_tokens  # the expected output when the limit is not set
    if path.endswith("/chat/completions"):
        text, ids = _text_of(body.get("messages", []))
        # Both limits are checked: vLLM 0.33 takes max_completion_tokens unless it is null,
        # SGLang 0.5.23 unless it is null or 0, and then max_tokens.
        unset = _output_tokens(body.get("max_tokens"), "max_tokens", unset, max_output_tokens)
        key = "max_completion_tokens"
        out = body.get(key)
    elif path == "/generate":
        text, ids = _text_of(body.get("text", body.get("input_ids", "")))
        sp = body.get("sampling_params")
        key = "sampling_params.max_new_tokens"
        out = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    else:
        text, ids = _text_of(body.get("prompt", ""))
        key = "max_tokens"
        out = body.get(key)
    output = _output_tokens(out, key, unset, max_output_tokens)
    prompt = ids + (count(text) if text else 0)
    return Work(prompt, output, body.get("stream", False) is True)


#: Bytes of a JSON string literal (escapes included), for :func:`json_too_deep`.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: Every byte but the four brackets, deleted by :func:`json_too_deep`.
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
#: Opening brackets to +1, closing ones to -1 (as int8).
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def json_too_deep(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects more than ``limit`` levels
    deep, read without parsing it, in C-speed passes.

    Bytes inside string literals do not count. A text with at most ``limit`` opening
    brackets is answered from two counts alone (a chat request has a handful). Malformed
    JSON gets some answer (the parser refuses it afterwards).
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if len(brackets) <= limit:
        return False
    steps = np.frombuffer(brackets.translate(_BRACKET_STEP), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max()) > limit


def parse_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The JSON object of a request body, refused before parsing when it nests deeper
    than ``max_depth`` (the standard library's parser recurses once per level).

    Raises:
        InputError: too deep, not JSON, or not an object (field ``body``).
    """
    if json_too_deep(raw, max_depth):
        raise InputError(
            f"JSON nests more than {max_depth} levels deep (the router's --max-json-depth)",
            field="body",
        )
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise InputError(f"is not JSON: {_show(str(exc))}", field="body") from None
    if not isinstance(body, dict):
        raise InputError("must be a JSON object", field="body")
    return body


def pick_tier(
    headers: Mapping[str, str],
    *,
    tiers: Container[str],
    api_key_tiers: Mapping[str, str],
    priority_tiers: Mapping[str, str],
    default_tier: str,
    tier_headers: bool = True,
) -> str:
    """The tier of a request: the ``X-Mixfleet-Tier`` header, else the tier of its API key
    (``Authorization: Bearer KEY``), else of its ``X-Priority-Class``, else the default.

    With ``tier_headers`` False the two headers are ignored (the API key or the default
    decides): where API keys define tiers, a client must not pick its own.

    Raises:
        InputError: the header names a tier the router does not serve.
    """
    tier = headers.get(TIER_HEADER) if tier_headers else None
    if tier is not None:
        if tier not in tiers:
            raise InputError(
                f"names tier {_show(tier)}, which this router does not serve. To fix: use "
                "one of the tiers of the router's --instance flags",
                field=TIER_HEADER,
            )
        return tier
    auth = headers.get("Authorization", "")
    if auth.startswith("Bearer ") and auth[7:] in api_key_tiers:
        return api_key_tiers[auth[7:]]
    cls = headers.get(PRIORITY_HEADER) if tier_headers else None
    if cls is not None and cls in priority_tiers:
        return priority_tiers[cls]
    return default_tier


def pin_rank(
    engine: str, body: MutableMapping[str, Any], headers: MutableMapping[str, str], rank: int
) -> None:
    """Write the DP rank into the request where ``engine`` reads it (module docstring)."""
    if engine == "sglang":
        body.pop("data_parallel_rank", None)  # deprecated alias; it would be overridden
        body["routed_dp_rank"] = rank
    elif engine == "trtllm":
        # trtllm-serve refuses unknown body fields and has no rank field (module docstring:
        # tensorrt_llm/serve/openai_protocol.py, main at 0076e939); the engine balances.
        return
    else:  # vllm, native
        headers[RANK_HEADER] = str(rank)


#: The body fields that name SGLang's rank (the current name and its deprecated alias).
_SGLANG_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")


def pinned_body(
    engine: str,
    raw: bytes,
    body: MutableMapping[str, Any],
    headers: MutableMapping[str, str],
    rank: int,
) -> bytes:
    """The bytes to forward for a request whose JSON body ``raw`` parsed to ``body``, with
    the rank written where ``engine`` reads it (as :func:`pin_rank`).

    Engines that read the rank from a header (vLLM, native) and trtllm get ``raw``
    unchanged (no re-serialisation). For SGLang the field is appended inside the closing
    brace of ``raw`` when that is exact: ``raw`` is UTF-8 without a byte-order mark (what
    ``json.detect_encoding`` reports) and names neither rank field, so the object parsed
    is ``body`` plus the one field. Otherwise (a client-sent rank to override, another
    encoding) the body is serialised again from ``body``.
    """
    if engine != "sglang":
        pin_rank(engine, body, headers, rank)
        return raw
    if json.detect_encoding(raw) == "utf-8" and not any(f in body for f in _SGLANG_RANK_FIELDS):
        head = raw.rstrip()[:-1]  # a JSON object's last non-blank byte is its "}"
        sep = b"," if body else b""
        return b'%s%s"routed_dp_rank":%d}' % (head, sep, rank)
    pin_rank(engine, body, headers, rank)
    return json.dumps(body).encode()
