"""`python -m worker` = the `worker` command."""

from worker.cli import main

main()
