"""`python -m tiermem` runs the command line."""

import sys

from tiermem.cli import main

sys.exit(main())
