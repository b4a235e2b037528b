"""Suite-wide fixtures.

Code under test configures structlog with the stream that is ``sys.stderr`` at that moment;
under pytest that is a capture buffer closed when the test ends, so a later test that logs
through the same configuration would write to a closed file. Every test starts from
structlog's defaults instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()
