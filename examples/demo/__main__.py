"""``python -m demo`` (with ``examples`` on the path; ``make demo``)."""

import sys

from demo import main

sys.exit(main())
