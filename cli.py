"""Run the ``cukern`` command line from a source checkout: ``python cli.py --help``."""

from cukern.cli import main

if __name__ == "__main__":
    main()
