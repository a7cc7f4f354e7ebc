"""`python -m kvpact.worker` = the `worker` command."""

from kvpact.worker.cli import main

main()
