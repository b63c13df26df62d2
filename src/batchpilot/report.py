"""Deprecated alias of :mod:`batchpilot.app.report`, kept so that old imports keep working."""

import warnings

from .app.report import *  # noqa: F401,F403
from .app.report import __all__  # noqa: F401

warnings.warn("batchpilot.report is deprecated; import batchpilot.app.report", DeprecationWarning, stacklevel=2)
