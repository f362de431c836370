"""One sweep model's llama.cpp references (run by scripts/fidelity-refs.sh against a running
llama-server): greedy tokens and the top-1/top-2 logit gap at each step, one JSON line a prompt."""
import json
import os

import requests

url = f"http://127.0.0.1:{os.environ['PORT']}"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a stranger arrived "
    "with a broken pocket watch and a strange request:",
]
N = 32
for prompt in PROMPTS:
    ids = requests.post(f"{url}/tokenize", json={"content": prompt, "add_special": True,
                                                  "parse_special": True}).json()["tokens"]
    r = requests.post(f"{url}/completion", json={
        "prompt": ids, "n_predict": N, "temperature": 0, "n_probs": 2, "ignore_eos": True,
        "cache_prompt": False, "stream": False, "return_tokens": True}).json()
    out_ids = r["tokens"]
    assert len(out_ids) == N, f"{prompt!r}: {len(out_ids)} tokens"
    # A step without probabilities (a token ending inside a UTF-8 character), or whose pick was
    # not the raw top-1 (ignore_eos banned it), has no known gap: it counts as a tie (0).
    steps = iter(r["completion_probabilities"])
    s = next(steps, None)
    gaps = []
    for t in out_ids:
        if s is None or s["id"] != t:
            gaps.append(0.0)
            continue
        top = s["top_logprobs"]
        gaps.append(round(top[0]["logprob"] - top[1]["logprob"], 5) if top[0]["id"] == t else 0.0)
        s = next(steps, None)
    print(json.dumps({
        "variant": os.environ["VARIANT"], "prompt": prompt, "prompt_ids": ids,
        "output_ids": out_ids, "top1_top2_logit_gap": gaps,
        "tool": "llama-server /completion temperature 0, n_probs 2, ignore_eos, "
                f"-fa {os.environ['FA']}, prompt as /tokenize ids",
        "llama_cpp": os.environ["VERSION"], "model_sha256": os.environ["SHA"],
    }))
