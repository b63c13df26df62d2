"""The finder's answer explains itself: ``str(plan)`` / ``plan.describe()`` and a short ``repr``."""

from __future__ import annotations

import torch
from torch import nn

from batchpilot import find_batch_size_for
from batchpilot.find.result import BatchPlan, MemoryFit, trial_line
from batchpilot.policy.search import Trial
from summary import assert_explains


def test_a_search_prints_its_answer_limit_line_trials_and_what_would_raise_it():
    model = nn.Linear(8, 4)
    plan = find_batch_size_for(model, (torch.randn(4, 8), torch.randint(0, 4, (4,))), loss_fn=nn.CrossEntropyLoss(),
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1), capacity="64KiB",
                               timed_steps=0)
    text = str(plan)
    assert text == plan.describe()
    assert text.splitlines()[0].startswith(f"batch size {plan.batch_size} on cpu: the largest that fits")
    assert_explains(text, figure="tensor bytes", target="80% of 64.00 KiB", model="memory line:")
    assert f"{plan.num_trials} trials, {plan.num_ooms} OOM" in text
    assert "target=0.9 (about" in text  # a larger share, with the batch the line puts there
    assert repr(plan).startswith(f"BatchPlan(batch_size={plan.batch_size}, limit_bytes={plan.limit_bytes}, ")
    assert len(repr(plan)) < 300


def test_a_host_plan_says_what_was_in_use_the_binding_limit_and_the_cap_that_stopped_it():
    trials = [Trial(batch_size=2, outcome="fit", peak_bytes=310 << 20, seconds=1.0),
              Trial(batch_size=4, outcome="fit", peak_bytes=320 << 20, seconds=1.0),
              Trial(batch_size=64, outcome="oom", peak_bytes=900 << 20, seconds=2.0),
              Trial(batch_size=48, outcome="fit", peak_bytes=700 << 20, seconds=1.5)]
    plan = BatchPlan(batch_size=48, target=0.8, capacity=1 << 30, limit_bytes=(300 << 20) + int(0.8 * (724 << 20)),
                     strategy="predict", device="cpu", trials=trials, memory="address_space",
                     binding_limit="rlimit_as", base_bytes=300 << 20, stop_reason="max_batch_size",
                     fit=MemoryFit(fixed_bytes=300 << 20, bytes_per_sample=5 << 20), largest_fitting=48)
    text = str(plan)
    assert_explains(text, figure="address space", target="80% of the 724.00 MiB the rlimit_as limit leaves",
                    model="memory line: 300.00 MiB + 5.00 MiB per sample")
    assert "300.00 MiB in use" in text and "4 trials, 1 OOM" in text and "64 ran out of memory" in text
    assert "to raise it: max_batch_size stopped it (the memory line allows about 115)" in text
    assert trial_line(trials[2], plan.limit_bytes) == "batch 64: out of memory (needs at least 900.00 MiB), 2.0s"
