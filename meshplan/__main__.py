"""``python -m meshplan``: the same as the ``meshplan`` console script."""

import sys

from meshplan.cli import main

sys.exit(main())
