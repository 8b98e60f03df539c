"""`python -m optimizer ...`: the same command line as the `optimizer` script."""

from optimizer.cli.app import main

main()
