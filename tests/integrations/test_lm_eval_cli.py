"""``python -m batchpilot.integrations.lm_eval``: lm-eval's own command line with the ``batchpilot`` model.

lm-eval 0.4.13 finds models in its registry only, so the module registers the model and hands over
to ``lm_eval``'s command line. A local task (a JSON file, no download) runs end to end in a fresh
process; its logged samples are HFLM's results at batch size 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

import tiny_llama  # noqa: E402
from dist_launch import ROOT  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

CONTEXT = 96


def test_the_lm_eval_command_line_with_batchpilot_registered(tmp_path) -> None:
    model, tok = tiny_llama.model(context=CONTEXT), tiny_llama.tokenizer()
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=1)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    requests = tiny_llama.loglikelihood_requests(12, context=CONTEXT, long=1)[:12]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for req in requests:
            f.write(json.dumps({"context": req.args[0], "target": req.args[1]}) + "\n")
    (tmp_path / "bp_local.yaml").write_text(
        "task: bp_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'docs.jsonl'}\noutput_type: loglikelihood\ntest_split: test\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(
        [sys.executable, "-m", "batchpilot.integrations.lm_eval", "--model", "batchpilot", "--model_args",
         f"pretrained={tmp_path / 'model'},capacity=1MiB,target=0.7", "--tasks", "bp_local", "--include_path",
         str(tmp_path), "--device", "cpu", "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bp_local" in out.stdout and "batchpilot" in out.stdout
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_bp_local_*.jsonl")
               for line in path.read_text().splitlines()]
    got = {s["doc_id"]: s["resps"][0][0] for s in samples}
    want = ref.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(requests)
    for i, (value, greedy) in enumerate(want):
        assert float(got[i][0]) == pytest.approx(value, rel=1e-5, abs=1e-4) and got[i][1] in (greedy, str(greedy))
