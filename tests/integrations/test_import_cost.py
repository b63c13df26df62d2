"""What importing each public module costs: modules and address space, in a fresh process, held to a budget.

A helper imports what it uses. One fresh interpreter imports, in order, each module's framework
base (what its classes subclass: lm-eval's ``HFLM``, Lightning's ``Callback``; nothing for a
module whose functions import their framework when called) and then the module, and counts what the module added: modules in ``sys.modules`` and
mapped address space (``VmSize``, what ``RLIMIT_AS`` counts). The modules without a framework
base come first, so nothing imported before them hides what they would load.
``import batchpilot.integrations.transformers`` (for ``continuous_batching_config``) must not load
the ``Trainer`` stack; ``ResilientTrainer`` still does, when it is used, and is the Trainer subclass.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

MiB = 2**20

#: (module, the framework base imported just before it, the package it needs installed), in import order
CASES = [
    ("batchpilot", "torch", None),
    ("batchpilot.integrations", None, None),
    ("batchpilot.integrations.continuous", None, "transformers"),
    ("batchpilot.integrations.transformers", None, "transformers"),
    ("batchpilot.integrations.accelerate", None, "accelerate"),
    ("batchpilot.integrations.lm_eval", "lm_eval.models.huggingface", "lm_eval"),
    ("batchpilot.integrations.lightning", "lightning.pytorch", "lightning"),
]
#: the most modules and address space a module may add beyond its base: batchpilot's own modules only
BUDGET = {"batchpilot": (120, 24 * MiB)}
DEFAULT_BUDGET = (30, 8 * MiB)

_MEASURE = r"""
import importlib, json, sys
def vm():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * 4096
out = {}
for module, base in json.loads(sys.argv[1]):
    if base:
        importlib.import_module(base)
    mods, space = set(sys.modules), vm()
    importlib.import_module(module)
    added = set(sys.modules) - mods
    out[module] = {"modules": len(added), "bytes": vm() - space, "trainer": "transformers.trainer" in sys.modules,
                   "others": sorted({m.split(".")[0] for m in added} - {"batchpilot"} - sys.stdlib_module_names
                                    - {m for m in sys.builtin_module_names})}
if "batchpilot.integrations.transformers" in out:
    from batchpilot.integrations.transformers import ResilientTrainer, ResilientTrainerMixin
    from transformers import Trainer
    import pickle
    hf = sys.modules["batchpilot.integrations.transformers"]
    out["ResilientTrainer"] = [issubclass(ResilientTrainer, Trainer), issubclass(ResilientTrainer, ResilientTrainerMixin),
                               ResilientTrainer is hf.ResilientTrainer, "ResilientTrainer" in dir(hf),
                               pickle.loads(pickle.dumps(ResilientTrainer)) is ResilientTrainer]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def costs() -> dict:
    cases = [(m, b) for m, b, needs in CASES if needs is None or importlib.util.find_spec(needs) is not None]
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(cases)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("module", "base", "needs"), CASES, ids=[c[0] for c in CASES])
def test_importing_a_module_costs_only_what_it_uses(costs, module, base, needs):
    if module not in costs:
        pytest.skip(f"needs {needs}")
    cost = costs[module]
    assert cost["others"] == [], f"{module} imports {cost['others']} beyond {base}: import them where they are used"
    most_modules, most_bytes = BUDGET.get(module, DEFAULT_BUDGET)
    assert cost["modules"] <= most_modules, cost
    assert cost["bytes"] <= most_bytes, cost
    if module == "batchpilot.integrations.transformers":
        assert not cost["trainer"], "the Trainer stack was imported with continuous_batching_config"


def test_resilient_trainer_is_the_trainer_subclass_when_used(costs):
    if "ResilientTrainer" not in costs:
        pytest.skip("needs transformers")
    # a subclass of Trainer and of the mixin, one class (cached), listed by dir(), pickled by name
    assert costs["ResilientTrainer"] == [True] * 5, costs["ResilientTrainer"]
