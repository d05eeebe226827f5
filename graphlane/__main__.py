"""``python -m graphlane``: the command line (:mod:`graphlane.cli`)."""

import sys

from graphlane.cli import main

if __name__ == "__main__":
    sys.exit(main())
