"""``python -m arbor`` is the ``arbor`` command (used by launchers such as ``deepspeed -m arbor``)."""

import sys

from arbor.cli import main

sys.exit(main())
