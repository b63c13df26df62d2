"""The memory model of generate on a real device: predictions against measured peaks, and a batched run.

A Llama built from a config (random weights, no download) on the device:

1. ``fit_generation_memory`` at three prompt lengths under an emulated capacity (on CUDA a
   memory fraction: the allocator's real OOM past it), then a plain ``generate`` at shapes no
   trial ran, measured with ``track_peak`` (allocated bytes) and the reserved bytes, against the
   model's prediction;
2. ``generate_by_length`` over long-tailed prompts under that capacity, sizing included (``--small``:
   on the fit of 1): batches, OOMs, seconds, and how many outputs equal generating the prompt
   alone (a sample of them).

    python benchmarks/generation_gpu.py                       # CUDA, a 1024-wide Llama in bf16
    python benchmarks/generation_gpu.py --device cpu --small  # a tiny one on CPU (the tests' size)

Prints one JSON object (and writes it to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from batchpilot.infer.generate import generate_by_length  # noqa: E402
from batchpilot.infer.genmemory import fit_generation_memory  # noqa: E402
from batchpilot.memory.probes import emulate_capacity, track_peak  # noqa: E402

PAD = 0


def build(device: str, small: bool, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        cfg = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
    else:
        cfg = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg, pad_token_id=PAD, bos_token_id=1, eos_token_id=None))
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(L)] for L in lengths]


def measured(model, device: str, capacity: int, b: int, P: int, N: int, vocab: int) -> dict:
    """A plain generate of b real prompts left-padded to P: its allocated and reserved growth."""
    rows = prompts_of([P] + [random.Random(b * P).randint(max(1, P // 2), P) for _ in range(b - 1)], vocab, b + P)
    cuda = device.startswith("cuda")
    with emulate_capacity(capacity, device, track=[model]):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            reserved0 = torch.cuda.memory_reserved()
        with track_peak(device) as m:
            ids = torch.full((b, P), PAD, device=device)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(rows):
                ids[i, P - len(p):] = torch.tensor(p, device=device)
                mask[i, P - len(p):] = 1
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False, pad_token_id=PAD)
            del ids, mask
        reserved = torch.cuda.max_memory_reserved() - reserved0 if cuda else None
    return {"allocated": m.peak_bytes - m.start_bytes, "reserved": reserved}


def alone(model, prompt: list[int], n: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="the tests' tiny Llama (CPU-sized)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on CUDA, float32 on CPU)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model = build(args.device, args.small, dtype)
    vocab = model.config.vocab_size
    if args.small:
        capacity, lengths, new, shapes = 2 * 2**20, (6, 18, 44), 8, [(3, 30, 8), (5, 10, 8), (4, 10, 40), (5, 4, 44)]
        tail = [random.Random(i).choice([4, 8, 12, 20, 40]) for i in range(24)]
        gen_new, sample = 8, 12
    else:
        capacity, lengths, new = 8 * 2**30, (64, 256, 1024), 128
        shapes = [(24, 512, 128), (64, 128, 128), (40, 700, 64), (96, 64, 256), (16, 1000, 160), (200, 100, 32)]
        rng = random.Random(0)
        tail = [min(1900, int(rng.lognormvariate(3.8, 0.9)) + 2) for _ in range(190)] + [rng.randint(500, 900)
                                                                                         for _ in range(10)]
        gen_new, sample = 48, 24
    report: dict = {"device": str(args.device), "dtype": str(dtype), "capacity": capacity,
                    "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    began = time.perf_counter()
    memory = fit_generation_memory(model, prompt_lengths=lengths, max_new_tokens=new, pad_token_id=PAD,
                                   capacity=capacity, device=args.device)
    report["fit_seconds"] = time.perf_counter() - began
    report["terms"] = memory.terms()
    report["trials"] = [t.to_dict() for t in memory.trials]
    report["answers"] = {f"{P}+{new}": memory.max_batch(P, new) for P in lengths}
    rows = []
    for b, P, N in shapes:
        m = measured(model, args.device, capacity, b, P, N, vocab)
        tensors = memory.tensor_growth(b, P, N)
        figure = m["reserved"] if m["reserved"] is not None else m["allocated"]
        rows.append({"shape": [b, P, N], "allocated": m["allocated"], "reserved": m["reserved"],
                     "model_tensors": tensors, "model_with_scale": memory.growth(b, P, N),
                     "error_vs_allocated": tensors / m["allocated"] - 1,
                     "error_vs_figure": memory.growth(b, P, N) / figure - 1,
                     "binds": "prefill" if memory.prefill_bytes(b, P) >= memory.decode_bytes(b, P + N) else "decode"})
    report["unfitted"] = rows
    prompts = prompts_of(tail, vocab, 7)
    began = time.perf_counter()
    # the small run reuses the fit (its trials are the tests' already); the full one sizes itself
    out = generate_by_length(model, prompts, max_new_tokens=gen_new, pad_token_id=PAD, capacity=capacity,
                             device=args.device, memory=memory if args.small else None)
    report["run"] = {"prompts": len(prompts), "seconds": time.perf_counter() - began,
                     "sizing_seconds": out.sizing_seconds, "batches": out.batches, "ooms": out.ooms,
                     "trials": len(out.trials), "scale": out.memory.scale if out.memory else None}
    picks = random.Random(1).sample(range(len(prompts)), min(sample, len(prompts)))
    same = sum(alone(model, prompts[i], gen_new, args.device) == out[i] for i in picks)
    report["run"]["identical_to_alone"] = f"{same}/{len(picks)}"
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return report


if __name__ == "__main__":
    main()
