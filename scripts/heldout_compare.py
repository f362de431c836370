"""Teacher-forced top-1 of `npu-serving score` on one device against llama.cpp's greedy references
(scripts/fidelity_refs_run.py's JSON lines) at their decided steps (gap >= 0.15).
    python heldout_compare.py NPU_SERVING DEVICE MODEL.gguf...   (refs beside each: MODEL.refs.jsonl)
Prints a line per model and a total; exits 1 when any model could not be scored."""
import json
import subprocess
import sys

npu, device = sys.argv[1], sys.argv[2]
total = same_total = 0
failed = False
for model in sys.argv[3:]:
    decided = same = 0
    misses = []
    for line in open(model[:-len(".gguf")] + ".refs.jsonl"):
        r = json.loads(line)
        run = subprocess.run([npu, "score", "--model", model, "--device", device, "--prompt",
                              r["prompt"], "--continuation-ids",
                              ",".join(map(str, r["output_ids"])), "--json"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{model} [{device}]: not scored: {run.stderr.strip()[-300:]}")
            failed = True
            break
        got = json.loads(run.stdout)
        if got["prompt_ids"] != r["prompt_ids"]:
            print(f"{model} [{device}]: prompt ids differ from llama.cpp's: {got['prompt_ids']}")
            failed = True
            break
        for i, (tok, gap) in enumerate(zip(r["output_ids"], r["top1_top2_logit_gap"])):
            if gap >= 0.15:
                decided += 1
                top = got["positions"][i]
                if top["top1_id"] == tok:
                    same += 1
                else:
                    misses.append(f"prompt {r['prompt'][:16]!r} step {i}: llama.cpp gap {gap}")
    total += decided
    same_total += same
    print(f"{model.split('/')[-1]} [{device}]: {same}/{decided} decided steps as llama.cpp's"
          + (f"; differs at {misses}" if misses else ""))
print(f"all [{device}]: {same_total}/{total} ({100 * same_total / max(total, 1):.2f}%)")
sys.exit(1 if failed else 0)
