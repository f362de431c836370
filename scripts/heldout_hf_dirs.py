"""The held-out Hugging Face directories themselves (scripts/heldout_models.py's output) loaded by
`npu-serving generate --model DIR` on the CPU, against transformers' own greedy decoding of the
same directory in f32: the tokens must be equal up to transformers' first near-tie (top-1/top-2
logit gap below 0.15). Run with the converter's virtual environment (torch, transformers).
    python heldout_hf_dirs.py NPU_SERVING HELDOUT_DIR NAME...
Exits 1 when a directory's tokens differ before a near-tie or it cannot be loaded."""
import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old "
           "clockmaker who repaired every clock in the valley."]
npu, root = sys.argv[1], sys.argv[2]
bad = False
for name in sys.argv[3:]:
    path = f"{root}/{name}"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        run = subprocess.run([npu, "generate", "--model", path, "--prompt", prompt,
                              "--max-tokens", "32", "--ignore-eos", "--json"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{name}: not loaded: {run.stderr.strip()[-300:]}")
            bad = True
            break
        ours = json.loads(run.stdout)
        ids = torch.tensor([ours["prompt_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                 do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        theirs = out.sequences[0, ids.shape[1]:].tolist()
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        tie = next((i for i, g in enumerate(gaps) if g < 0.15), len(gaps))
        diff = next((i for i, (a, b) in enumerate(zip(ours["output_ids"], theirs)) if a != b),
                    None)
        ok = diff is None or diff >= tie
        bad |= not ok
        print(f"{name} {prompt[:16]!r}: {'as' if ok else 'NOT as'} transformers' tokens "
              f"(first difference {diff}, first near-tie {tie})")
sys.exit(1 if bad else 0)
