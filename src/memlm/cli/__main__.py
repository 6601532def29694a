"""``python -m memlm.cli``: the ``memlm`` command."""

import sys

from memlm.cli import main

sys.exit(main())
