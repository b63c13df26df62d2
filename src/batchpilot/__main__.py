"""``python -m batchpilot``: the same as the ``batchpilot`` command."""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
