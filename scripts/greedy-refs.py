#!/usr/bin/env python3
"""Writes llama.cpp greedy references for prompts, one JSON object per line, in the format the
fidelity tests read (agent/tests/data/*.jsonl): prompt ids, greedy output ids and text, and each
step's top-1/top-2 log-probability gap (a full softmax, so the logit gap) with the first step whose
gap is below 0.15 (a near-tie, past which llama.cpp's own choice is not stable).

  scripts/greedy-refs.py URL PROMPTS.json OUT.jsonl [--n 32]

URL is a running llama-server (for example `llama-server -m MODEL --port 18080`); PROMPTS.json a
JSON list of prompt strings. Needs the Python `requests` package."""
import argparse, json, requests

ap = argparse.ArgumentParser()
ap.add_argument("url"); ap.add_argument("prompts"); ap.add_argument("out")
ap.add_argument("--n", type=int, default=32)
a = ap.parse_args()
props = requests.get(f"{a.url}/props").json()
build = props.get("build_info", "")
with open(a.out, "w") as out:
    for prompt in json.load(open(a.prompts)):
        ids = requests.post(f"{a.url}/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
        r = requests.post(f"{a.url}/completion", json={
            "prompt": ids, "n_predict": a.n, "temperature": 0, "n_probs": 2,
            "ignore_eos": True, "return_tokens": True, "cache_prompt": False,
            "post_sampling_probs": False}).json()
        probs = r["completion_probabilities"]
        gaps = [round(p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"], 5) for p in probs]
        near = next((i for i, g in enumerate(gaps) if g < 0.15), None)
        out.write(json.dumps({
            "prompt": prompt, "prompt_ids": ids, "output_ids": r["tokens"],
            "output_text": r["content"],
            "tool": "llama-server /completion temperature 0, n_probs 2 (full-softmax logprobs), ignore_eos",
            "commit": f"build {build}", "top1_top2_logit_gap": gaps,
            "second_best_ids": [p["top_logprobs"][1]["id"] for p in probs],
            "first_step_gap_below_0.15": near}) + "\n")
