"""Integration tests: each module skips, with the reason, when its framework is not installed.

Lightning and transformers import about 450,000 Python objects, which every later ``gc.collect()``
walks (0.7 s on the 2-core CI machine): batchpilot's ``free_memory`` runs one at each search's start
and end and after each OOM, here and in every test file collected after this directory. The
imports never become garbage, so they are frozen out of the collector once collection is done.
"""

from __future__ import annotations

import gc


def pytest_collection_finish(session) -> None:
    gc.freeze()
