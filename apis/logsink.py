"""Where structlog writes: the process's standard error as it is when a logger is made.

``structlog.PrintLoggerFactory(sys.stderr)`` binds the stream object present when logging is
configured; if that stream is later replaced and closed (a test harness capturing output, a
daemon redirecting its streams), every later log line fails with "I/O operation on closed
file". :func:`stderr_logger` looks ``sys.stderr`` up each time structlog makes a logger.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import structlog


def stderr_logger(*_args: object) -> structlog.PrintLogger:
    """A structlog logger factory (``logger_factory=stderr_logger``) on the current stderr."""
    return structlog.PrintLogger(sys.stderr)


def logger_factory(stream: TextIO | None) -> Callable[..., Any]:
    """``stream``'s factory when one is given, else :func:`stderr_logger`."""
    if stream is None:
        return stderr_logger
    return structlog.PrintLoggerFactory(stream)
