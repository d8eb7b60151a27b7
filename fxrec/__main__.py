"""``python -m fxrec ...``: the same as the ``fxrec`` command (see fxrec/cli.py)."""

import sys

from .cli import main

sys.exit(main())
