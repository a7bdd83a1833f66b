"""`python -m gateway.cli`: the `kvgate` command, as the console script runs it."""

import sys

from gateway.cli.main import main

sys.exit(main())
