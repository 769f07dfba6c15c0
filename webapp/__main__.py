"""``python -m webapp``: the command line (see ``webapp/cli/``)."""

import sys

from webapp.cli import main

sys.exit(main())
