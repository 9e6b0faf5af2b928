"""``python -m cukern.cli``: the command line."""

from . import main

main()
