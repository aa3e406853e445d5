"""``python -m dsv41attn``: the command line of ``dsv41attn.cli``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
