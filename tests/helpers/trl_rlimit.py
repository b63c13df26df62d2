"""ResilientGRPOTrainer in a process whose address space is capped just before ``train()``.

The asked batch (per-device 32, all 32 completions of a step in one forward) runs out of real
memory (PyTorch's ``DefaultCPUAllocator``) under the cap; the trainer must finish every step.
Prints ``steps S ooms O calls C`` (training OOMs retried; generate calls). Usage:
``trl_rlimit.py OUTPUT_DIR [HEADROOM_MIB]``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import tiny_llama as tl  # noqa: E402
from rlimit import cap_address_space  # noqa: E402

MiB = 2**20


def main() -> None:
    out = sys.argv[1]
    headroom = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig

    from batchpilot.integrations.trl import ResilientGRPOTrainer

    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING)
    tok = tl.tokenizer()
    model = tl.model(context=512, layers=2, hidden=64, seed=0).train()
    # two long prompts among short ones: the step that draws them pads every row to ~400 tokens
    prompts = tl.texts([380, 400] + [6, 9, 12, 5, 8, 10], seed=2)
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=32, num_generations=4, max_completion_length=16,
                      max_steps=2, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
                      gradient_checkpointing=False, disable_tqdm=True, seed=0, shuffle_dataset=False)

    def reward(completions, **kwargs):
        return [len(c) / 100 for c in completions]

    trainer = ResilientGRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                                   train_dataset=Dataset.from_dict({"prompt": prompts}))
    ooms = []

    def count(self_trainer=trainer):
        step = self_trainer.batchpilot_last_step
        ooms.append(step.ooms)

    from transformers import TrainerCallback

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            count()

    trainer.add_callback(Count())
    cap_address_space(headroom * MiB)
    trainer.train()
    calls = sum(g.calls for g in trainer.batchpilot_generation)
    print(f"steps {trainer.state.global_step} ooms {sum(ooms)} generation-ooms "
          f"{sum(g.ooms for g in trainer.batchpilot_generation)} calls {calls} "
          f"micro {trainer.batchpilot_last_step.micro_batch_sizes}", flush=True)


if __name__ == "__main__":
    main()
