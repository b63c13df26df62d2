"""Deprecated alias of :mod:`batchpilot.app.cli`, kept for old ``batchpilot.cli:main`` entry points."""

import warnings

from ..app.cli import *  # noqa: F401,F403
from ..app.cli import __all__  # noqa: F401

warnings.warn("batchpilot.cli is deprecated; import batchpilot.app.cli", DeprecationWarning, stacklevel=2)
