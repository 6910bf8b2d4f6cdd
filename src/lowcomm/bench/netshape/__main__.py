"""``python -m lowcomm.bench.netshape``: see :mod:`lowcomm.bench.netshape.cli`."""

import sys

from .cli import main

sys.exit(main())
