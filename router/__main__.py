"""`python -m router` = the `router` command."""

import sys

from router.cli import main

sys.exit(main())
