"""``python -m controlplane.cli``: the same as ``mixfleetctl``."""

import sys

from controlplane.cli import main

sys.exit(main())
