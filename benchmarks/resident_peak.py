"""The resident peak of a training step read two ways: the kernel's high-water mark, and batchpilot's sampler.

``batchpilot.memory.host.ResidentPeak`` no longer resets the process's high-water mark (``VmHWM``,
which ``ru_maxrss`` and ``/usr/bin/time`` report); below that mark it samples the resident size from a
process of its own every millisecond. This measures what the sampler misses: each row is a fresh
process (one intra-op thread, glibc's mmap threshold fixed as a search fixes it) that runs two Adam
steps of one of the reference models at one batch size, with the kernel's mark reset just before
(here, in a benchmark, on purpose) and the sampler's window open, and reports both peaks' growth
over the resident size at the start.

    python benchmarks/resident_peak.py [--sizes 8,32,96] [--models mlp,cnn,transformer]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, torch
from torch import nn
from batchpilot.memory.host import ResidentPeak, pin_malloc_threshold, resident_bytes, trim_host_memory
from batchpilot.memory.host import _status_kib
name, b = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
models = {
    "mlp": (lambda: nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)), (1024,)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)), (3, 64, 64)),
    "transformer": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 2), (128, 256)),
}
make, shape = models[name]
m = make(); opt = torch.optim.Adam(m.parameters()); x = torch.randn(b, *shape)
def step():
    m(x).float().pow(2).mean().backward(); opt.step(); opt.zero_grad(set_to_none=True)
pin_malloc_threshold()
step()
trim_host_memory()
peak = ResidentPeak()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start = resident_bytes()
peak.reset()
step(); step()
sampled = peak.peak()
peak.close()
kernel = _status_kib("VmHWM")
print(json.dumps({"model": name, "batch": b, "kernel": kernel - start, "sampled": sampled - start}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,32,96")
    ap.add_argument("--models", default="mlp,cnn,transformer")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1")
    print(f"resident peak of two Adam steps, the kernel's mark against the sampler, {datetime.date.today()}")
    print(f"{'model':<12} {'batch':>5} {'kernel (MiB)':>12} {'sampled (MiB)':>13} {'missed':>7}")
    for name in args.models.split(","):
        for b in args.sizes.split(","):
            out = subprocess.run([sys.executable, "-c", CHILD, name, b], capture_output=True, text=True, env=env,
                                 check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            missed = (row["kernel"] - row["sampled"]) / max(1, row["kernel"])
            print(f"{name:<12} {b:>5} {row['kernel'] / 2**20:>12.1f} {row['sampled'] / 2**20:>13.1f} {missed:>7.1%}")


if __name__ == "__main__":
    main()
