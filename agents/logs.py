"""structlog set-up for agents: one JSON object per line on stderr.

Agents bind ``node`` (and ``simulated``) to their logger, assignments add ``deployment``,
``plan`` and ``version``, so ``jq 'select(.node == "h100-0")'`` follows one node.
"""

from __future__ import annotations

import logging
from typing import TextIO

import structlog

from apis.logsink import logger_factory

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Route structlog to JSON lines on ``stream`` (stderr), dropping records below
    ``level``."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=logger_factory(stream),
        cache_logger_on_first_use=False,
    )
