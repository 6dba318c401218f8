"""``python -m rltserve``: the ``rltserve`` command."""

import sys

from rltserve.cli import main

sys.exit(main())
