"""`python -m kvpact.router` = the `router` command."""

import sys

from kvpact.router.cli import main

sys.exit(main())
