#!/usr/bin/env python3
"""The closed-loop load of scripts/compare-served.sh, for any OpenAI-compatible server (ours and
llama-server alike); standard library only.

    served-load.py --port PORT [--concurrency 32] [--requests 64] [--max-tokens 128] [--tag T]

CONCURRENCY workers send REQUESTS streaming POST /v1/completions to 127.0.0.1:PORT, a new request
as soon as one ends: temperature 0, ignore_eos, max_tokens MAX_TOKENS, usage in the last chunk.
Every prompt is different (a numbered document of 6-19 sentences, about 100-300 tokens, from a
fixed seed; TAG keeps two servers' prompts apart so no cache outlives a run), so no request reuses
another's prompt through a prefix cache. Prints one JSON line: requests served, wall time,
output tokens per second over the wall time, TTFT, time per output token and end-to-end latency
percentiles, and the first errors if any.
"""
import argparse
import http.client
import json
import random
import threading
import time

SENTENCES = (
    "Glaciers move slowly downhill under their own weight, carving wide valleys as they go.",
    "The night train left the station on time and reached the coast shortly after dawn.",
    "A cache keeps recently used data close to the processor so it can be read again.",
    "Farmers in the valley rotate their crops to keep the soil healthy.",
    "The orchestra rehearsed the last movement twice before the evening performance began.",
    "Bees visit thousands of flowers every day and carry pollen from one plant to another.",
    "The new bridge across the river shortened the commute for the east bank.",
    "A well written function does one thing and is easy to test on its own.",
    "Storms in the north brought heavy snow, and several mountain roads were closed overnight.",
    "The bakery on the corner sells fresh bread every morning and closes early on Sundays.",
    "Scientists measured the temperature of the lake at several depths all year.",
    "The old lighthouse still guides fishing boats safely into the harbour after sunset.",
)


def prompt(i, rng, tag):
    body = " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(6, 19)))
    return f"Document {tag}{i}: {body} In summary,"


def pct(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def one(port, text, max_tokens, timeout):
    req = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
           "ignore_eos": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    first = None
    pieces = 0
    usage = None
    finish = None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(req),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"ok": False, "error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    pieces += 1
                    if first is None:
                        first = time.perf_counter()
                finish = choice.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001 - any failure is a failed request
        return {"ok": False, "error": repr(e)}
    finally:
        conn.close()
    end = time.perf_counter()
    if first is None:
        return {"ok": False, "error": "no text streamed"}
    out = (usage or {}).get("completion_tokens") or (max_tokens if finish == "length" else pieces)
    return {"ok": True, "out": out, "ttft": first - start, "e2e": end - start,
            "tpot": (end - first) / max(out - 1, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    if not (1 <= a.concurrency <= 256 and 1 <= a.requests <= 1000):
        ap.error("concurrency must be 1-256 and requests 1-1000")
    rng = random.Random(a.seed)
    prompts = [prompt(i, rng, a.tag) for i in range(a.requests)]
    results = [None] * a.requests
    next_i = iter(range(a.requests))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            results[i] = one(a.port, prompts[i], a.max_tokens, a.timeout)

    workers = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    summary = {"concurrency": a.concurrency, "requests": a.requests, "ok": len(ok), "wall_s": round(wall, 2)}
    if ok:
        ttft = [r["ttft"] for r in ok]
        tpot = [r["tpot"] for r in ok]
        e2e = [r["e2e"] for r in ok]
        summary.update(output_tok_s=round(sum(r["out"] for r in ok) / wall, 1),
                       ttft_p50=round(pct(ttft, 50), 3), ttft_p99=round(pct(ttft, 99), 3),
                       tpot_p50_ms=round(1000 * pct(tpot, 50), 1),
                       e2e_p50=round(pct(e2e, 50), 2), e2e_p99=round(pct(e2e, 99), 2))
    errors = [r["error"] for r in results if not r["ok"]]
    if errors:
        summary["errors"] = errors[:3]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
