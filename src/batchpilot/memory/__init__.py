"""Memory: recognising an OOM, reading and limiting what a device holds.

:mod:`~batchpilot.memory.oom` (is it an OOM, recovering outside the ``except``),
:mod:`~batchpilot.memory.host` (the process's real memory), :mod:`~batchpilot.memory.limits` (the
kinds of limit -- emulated, device, address space, cgroup, RAM -- and which one binds),
:mod:`~batchpilot.memory.units` (byte sizes, devices), :mod:`~batchpilot.memory.tracker` (the exact
CPU storage tracker), :mod:`~batchpilot.memory.gauge` (``Gauge``: the one abstraction of a memory
figure -- current, peak since reset, capacity -- and the figure each device is judged on) and
:mod:`~batchpilot.memory.probes` (``track_peak``, ``emulate_capacity``, ``emulated_capacity`` and each
device's allocated-bytes gauge, ``get_probe``).
"""

from .limits import HostLimits, host_limits
from .oom import Attempt, attempt, free_memory, is_oom
from .probes import emulate_capacity, get_probe, track_peak
from .tracker import StorageTracker
from .units import format_bytes, parse_bytes

__all__ = [
    "is_oom", "attempt", "Attempt", "free_memory",
    "get_probe", "track_peak", "emulate_capacity", "StorageTracker",
    "parse_bytes", "format_bytes", "host_limits", "HostLimits",
]
