"""Deprecated alias of :mod:`batchpilot.app.datasets`, kept so that old imports keep working."""

import warnings

from .app.datasets import *  # noqa: F401,F403
from .app.datasets import __all__  # noqa: F401

warnings.warn("batchpilot.datasets is deprecated; import batchpilot.app.datasets", DeprecationWarning, stacklevel=2)
