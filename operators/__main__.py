"""``python -m operators run``: the ModelDeployment operator (see :mod:`operators.cli`)."""

from operators.cli import main

raise SystemExit(main())
