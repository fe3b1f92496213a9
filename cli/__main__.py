"""`python -m corral.cli ...` is the `corral` command."""

import sys

from corral.cli.main import main

sys.exit(main())
