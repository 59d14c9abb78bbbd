"""``python -m parallelvars``: the same command as the ``parallelvars`` console script.

This shim is the one place under ``parallelvars/`` that reaches into ``parallelvars.cli``;
the core modules never import the command line or the formats.
"""

import sys

from parallelvars.cli import main

if __name__ == "__main__":
    sys.exit(main())
