"""structlog setup for long-running processes (the controller): one JSON object per line
with ``timestamp``, ``level``, ``event`` and the bound ids (``deployment``, ``version``,
``plan_id``, ``node``)."""

from __future__ import annotations

import logging

import structlog

from apis.logsink import stderr_logger


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    """Send structlog output to stderr as JSON lines (``fmt="json"``) or readable text.

    Raises:
        ValueError: unknown format or level.
    """
    if fmt not in ("json", "console"):
        raise ValueError(f"unknown log format {fmt!r}; use json or console")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=stderr_logger,
        cache_logger_on_first_use=False,
    )
