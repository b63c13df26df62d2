"""A search on this host's real memory in a fresh process, and what it left of the process's state.

Prints one JSON line: for each piece of state the user owns (the resident high-water mark and
``ru_maxrss``, the RNG states, torch's thread count, the logging configuration, the warning
filters), whether it is as before two searches; and how often the one deliberate change (glibc's
mmap threshold) was logged. The process first holds and frees more memory than the searches use,
so a high-water mark the searches reset would show lower afterwards.
"""

from __future__ import annotations

import json
import logging
import random
import resource
import warnings

import numpy as np
import torch
from torch import nn

from batchpilot import find_batch_size_for
from batchpilot.memory.host import malloc_threshold_pinned, trim_host_memory


def high_water() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def logging_state() -> dict:
    """Every logger's configuration, by name; a logger made since (a module imported later) at the defaults."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return {lg.name: (lg.level, lg.propagate, lg.disabled, list(lg.handlers), list(lg.filters)) for lg in loggers}


UNTOUCHED = (logging.NOTSET, True, False, [], [])


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    counter = Count()
    logging.getLogger().addHandler(counter)  # the user's own configuration: INFO from every library
    logging.getLogger().setLevel(logging.INFO)
    spike = torch.ones(400 * 2**20 // 4)  # 400 MiB, written: the process's peak is from before any search
    del spike
    trim_host_memory()
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters())
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    torch.set_num_threads(2)
    before = {
        "high_water": high_water(), "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "numpy_rng": np.random.get_state()[1],
        "threads": torch.get_num_threads(), "logging": logging_state(), "warnings": list(warnings.filters),
    }
    plans = [find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), max_batch_size=mb)
             for mb in (64, 48)]
    after = {
        "high_water": high_water(), "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "numpy_rng": np.random.get_state()[1],
        "threads": torch.get_num_threads(), "logging": logging_state(), "warnings": list(warnings.filters),
    }
    made = {name: state for name, state in after["logging"].items() if name not in before["logging"]}
    after["logging"] = {name: state for name, state in after["logging"].items() if name in before["logging"]}
    same = {k: bool(torch.equal(before[k], after[k])) if isinstance(before[k], torch.Tensor)
            else bool(np.array_equal(before[k], after[k])) if isinstance(before[k], np.ndarray)
            else before[k] == after[k] for k in before}
    print(json.dumps({
        "same": same, "before": {k: before[k] for k in ("high_water", "maxrss")},
        "after": {k: after[k] for k in ("high_water", "maxrss")}, "memory": [p.memory for p in plans],
        "new_loggers_untouched": all(state == UNTOUCHED for state in made.values()),
        "pinned": malloc_threshold_pinned(),
        "pin_logged": sum("mmap threshold" in m for m in counter.messages),
    }))


if __name__ == "__main__":
    main()
