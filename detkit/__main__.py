"""``python -m detkit``: the same command line as the ``detkit`` console script."""

from detkit.toolkit.cli import main

main()
