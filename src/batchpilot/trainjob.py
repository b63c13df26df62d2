"""Deprecated alias of :mod:`batchpilot.app.trainjob`, kept so that old imports keep working."""

import warnings

from .app.trainjob import *  # noqa: F401,F403
from .app.trainjob import __all__  # noqa: F401

warnings.warn("batchpilot.trainjob is deprecated; import batchpilot.app.trainjob", DeprecationWarning, stacklevel=2)
