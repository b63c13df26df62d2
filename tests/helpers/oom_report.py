"""A real CPU allocator OOM under RLIMIT_AS, read by attempt(): prints one JSON line.

The failing allocation is one tensor of a known, odd size, so the test can check that
the report names exactly that size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rlimit import cap_address_space  # noqa: E402

from batchpilot.memory.oom import attempt  # noqa: E402

torch.empty(16).add_(1)  # allocator and kernels loaded before the cap
cap_address_space(64 * 2**20)
size = 256 * 2**20 + 12345  # over the headroom, and not a round number
outcome = attempt(torch.empty, size, dtype=torch.uint8)
report = outcome.report
print(json.dumps({
    "size": size,
    "oom": outcome.oom,
    "message": outcome.message,
    "report": dataclasses.asdict(report) if report else None,
    "min_peak_bytes": report.min_peak_bytes if report else None,
    "peak_basis": report.peak_basis if report else None,
}))
