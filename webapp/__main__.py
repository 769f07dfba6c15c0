"""``python -m webapp``: the command line (see ``webapp/cli.py``)."""

import sys

from webapp.cli import main

sys.exit(main())
