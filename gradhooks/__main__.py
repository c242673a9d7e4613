"""``python -m gradhooks``: runs :func:`gradhooks.tools.cli.main` and exits with its return code."""
import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
