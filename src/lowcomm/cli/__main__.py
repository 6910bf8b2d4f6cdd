"""``python -m lowcomm.cli``: the ``lowcomm`` command."""

import sys

from . import main

sys.exit(main())
