"""Memory: recognising an OOM, reading and limiting what a device holds.

:mod:`~batchpilot.memory.oom` (is it an OOM, recovering outside the ``except``),
:mod:`~batchpilot.memory.host` (the process's real memory and its limits),
:mod:`~batchpilot.memory.units` (byte sizes, devices), :mod:`~batchpilot.memory.tracker` (the exact
CPU storage tracker), :mod:`~batchpilot.memory.probes` (figures per device, ``track_peak``,
``emulate_capacity``) and :mod:`~batchpilot.memory.gauge` (the one figure decisions use).
"""
