"""``python -m gradhooks``: runs :func:`gradhooks.cli.main` and exits with its return code."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
