"""Cap this process's address space, as a device with little memory would be.

Imported by the real-OOM helper scripts *after* torch is imported and warmed
up, so the cap only limits what the workload allocates from then on.
"""

from __future__ import annotations

import os
import resource

PAGE = os.sysconf("SC_PAGE_SIZE")


def vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * PAGE


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def cap_address_space(headroom_bytes: int) -> int:
    """Allow ``headroom_bytes`` of address space beyond what is mapped now; return the cap."""
    cap = vm_bytes() + headroom_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap
