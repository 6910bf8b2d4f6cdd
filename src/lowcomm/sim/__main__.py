"""``python -m lowcomm.sim``: the same as ``lowcomm simulate``."""

import sys

from .cli import main

sys.exit(main())
