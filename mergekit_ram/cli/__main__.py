"""``python -m mergekit_ram.cli``: the ``mergekit-ram`` command, for an environment without its console script."""

import sys

from mergekit_ram.cli import main

if __name__ == "__main__":
    sys.exit(main())
