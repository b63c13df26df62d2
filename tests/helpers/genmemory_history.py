"""Does a generation trial's figure depend on the trials before it? (A fresh process, set up as its user chose.)

    MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=1 python genmemory_history.py

Under ``RLIMIT_AS`` (what is mapped + 176 MiB, set once the model is built) runs real ``generate`` trials of
1, 2, 3, 2 and 1 prompts of 919 tokens (48 new) in one room, as the sizing does, and prints one JSON
line: each trial's growth of the address space, and whether glibc maps a freed 512 KiB block of
its own (so that freeing it leaves the address space) inside the room and after it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tiny_llama  # noqa: E402
from batchpilot.infer.genmemory import measure_generate, memory_room  # noqa: E402
from batchpilot.memory.host import address_space_bytes  # noqa: E402

_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


def mapped_alone(n: int) -> bool:
    """Whether glibc serves a block of ``n`` bytes by a mapping of its own (its chunk's IS_MMAPPED bit)."""
    p = _libc.malloc(n)
    try:
        return bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)
    finally:
        _libc.free(p)


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_llama.model(context=1024, layers=4, hidden=64, words=1000)
    # capped as soon as the model is built (no warm-up): the first trial also maps what generate
    # initialises once, and a heap left holding it is what later trials reuse
    cap = address_space_bytes() + 176 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out: dict = {"before": mapped_alone(512 * 1024), "growth": []}
    with memory_room(model) as room:
        out["inside"] = mapped_alone(512 * 1024)
        for b in (1, 2, 3, 2, 1):
            t = measure_generate(model, room, batch_size=b, prompt_length=919, max_new_tokens=48, pad_token_id=1,
                                 token_id=5, eos=(3,))
            out["growth"].append((b, t.peak_bytes, t.outcome))
    out["after"] = mapped_alone(512 * 1024)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
