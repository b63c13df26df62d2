"""The command line's old path, kept for ``batchpilot.cli:main`` console scripts of earlier installs.

It does not warn: such a script imports it from ``__main__`` on every run, where a
``DeprecationWarning`` would be shown to users who never wrote the import. New code
imports :mod:`batchpilot.app.cli`.
"""

from ..app.cli import *  # noqa: F401,F403
from ..app.cli import __all__  # noqa: F401
