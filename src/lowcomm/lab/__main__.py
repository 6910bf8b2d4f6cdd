"""``python -m lowcomm.lab CMD ...``: the ``lowcomm`` command with the lab registered by hand,
for a source tree that is not installed (``PYTHONPATH=src``: no entry points to find it by)."""

import sys

from lowcomm import plugins
from lowcomm.cli import main

from . import register

plugins.add(register)
sys.exit(main())
