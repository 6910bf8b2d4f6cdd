"""``python -m lowcomm.netshape``: see :mod:`lowcomm.netshape.cli`."""

import sys

from .cli import main

sys.exit(main())
