"""oneDNN's "could not create a primitive" at the edge of RLIMIT_AS, and far from it (fresh process).

A convolution at a batch size it has not run creates a oneDNN primitive (JIT code, scratch
buffers); with under a few MiB of address space left that mapping fails and oneDNN says only
that it could not create the primitive -- and creates none again in the process. Prints one JSON line that tests/memory/test_oom.py checks.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from rlimit import PAGE, cap_address_space, vm_bytes  # noqa: E402

from batchpilot.memory.oom import attempt, is_oom  # noqa: E402

torch.manual_seed(0)
conv = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
with torch.no_grad():
    conv(torch.randn(2, 3, 32, 32))
far = is_oom(RuntimeError("could not create a primitive"))  # the same words, with room to spare
cap = cap_address_space(512 * 2**20)
hog = torch.empty((cap - vm_bytes() - 64 * 2**10) // 4)  # all but 64 KiB of the address space


def forward() -> None:
    with torch.no_grad():
        conv(torch.randn(5, 3, 32, 32))  # a shape oneDNN has no primitive for yet


near = attempt(forward)
del hog
# oneDNN creates no primitive again in this process (a oneDNN limitation): attempt() turned its
# kernels off, so the same call runs on PyTorch's own
after = attempt(forward)
print(json.dumps({"far_is_oom": far, "near_oom": near.oom, "near_message": near.message, "after_ok": after.ok,
                  "onednn_on": torch.backends.mkldnn.enabled}))
