"""``python -m qkv ...``: the ``qkv`` command, for environments without its script on PATH."""

import sys

from qkv.cli import main

if __name__ == "__main__":
    sys.exit(main())
