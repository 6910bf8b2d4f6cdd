"""``python -m lowcomm.lab.sim``: the same as ``lowcomm simulate``."""

import sys

from .cli import main

sys.exit(main())
