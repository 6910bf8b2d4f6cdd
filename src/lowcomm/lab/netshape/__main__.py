"""``python -m lowcomm.lab.netshape``: see :mod:`lowcomm.lab.netshape.cli`."""

import sys

from .cli import main

sys.exit(main())
