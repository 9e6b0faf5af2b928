"""``python -m cukern``: the command line."""

from .cli import main

main()
