#!/usr/bin/env python3
"""A small prefix-aware router for the two-replica test (tests/e2e_kv_routing.rs).

It subscribes to each replica's KV-cache events with a real ZeroMQ SUB socket (pyzmq) and
decodes them with msgspec structs declared the way vLLM's own example subscriber declares them
(array_like, tagged), so the replicas' events are read exactly as a vLLM-compatible indexer
reads them. It keeps, per replica, the set of cached blocks keyed by its own chained hash of
their tokens (the engine's hashes are opaque to it: it maps each engine hash to its own key
when the block is stored, as llm-d's indexer does), and sends each request to the replica
holding the longest cached prefix of its prompt; with no match (or with --no-events) it falls
back to load: the replica that was sent the fewest requests so far, the first on a tie.

Usage: kv_router.py [--no-events] REQUESTS.json HTTP_ADDR=EVENTS_ADDR...
REQUESTS.json holds a list of token-id prompts. Prints a JSON report: one entry per request
with the replica chosen and how many leading blocks it was known to hold.
"""

import json
import sys
import time
import urllib.request

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Replica:
    def __init__(self, http, events, ctx):
        self.http = http
        self.sent = 0
        self.engine_to_key = {}  # engine hash -> (own key, medium)
        self.keys = {}  # own key -> count of media holding it
        self.block_size = None
        self.last_seq = None
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.connect(events)

    def apply(self, batch):
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.block_size = ev.block_size
                parent = None
                if ev.parent_block_hash is not None:
                    parent = self.engine_to_key.get(ev.parent_block_hash, (None,))[0]
                for i, h in enumerate(ev.block_hashes):
                    toks = tuple(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                    key = hash((parent, toks))
                    self.engine_to_key[h] = (key, ev.medium)
                    self.keys[key] = self.keys.get(key, 0) + 1
                    parent = key
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    known = self.engine_to_key.pop(h, None)
                    if known is not None:
                        key = known[0]
                        self.keys[key] -= 1
                        if self.keys[key] == 0:
                            del self.keys[key]
            else:
                self.engine_to_key.clear()
                self.keys.clear()

    def drain(self, wait_s):
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0, deadline - time.monotonic())
            if not self.sock.poll(int(left * 1000)):
                return
            topic, seq, payload = self.sock.recv_multipart()
            assert topic.startswith(b"kv@"), topic
            seq = int.from_bytes(seq, "big")
            if self.last_seq is not None:
                assert seq > self.last_seq, (self.last_seq, seq)
            self.last_seq = seq
            self.apply(DECODER.decode(payload))

    def matched_blocks(self, prompt):
        if not self.block_size:
            return 0
        parent, n = None, 0
        bs = self.block_size
        for i in range(len(prompt) // bs):
            key = hash((parent, tuple(prompt[i * bs:(i + 1) * bs])))
            if key not in self.keys:
                break
            parent, n = key, n + 1
        return n


def complete(http, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://{http}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200, r.status
        json.load(r)


def main():
    args = sys.argv[1:]
    use_events = True
    if args and args[0] == "--no-events":
        use_events, args = False, args[1:]
    prompts = json.load(open(args[0]))
    ctx = zmq.Context()
    replicas = [Replica(*a.split("="), ctx) for a in args[1:]]
    # A SUB socket's subscription reaches the publisher after the connection is made.
    time.sleep(0.5)
    report = []
    for prompt in prompts:
        if use_events:
            for r in replicas:
                r.drain(0.05)
        matched = [r.matched_blocks(prompt) if use_events else 0 for r in replicas]
        best = max(matched)
        if best > 0:
            choice = matched.index(best)
        else:
            choice = min(range(len(replicas)), key=lambda i: (replicas[i].sent, i))
        replicas[choice].sent += 1
        complete(replicas[choice].http, prompt)
        if use_events:
            # The prompt's blocks were stored during its prefill: their events are out by now.
            replicas[choice].drain(0.5)
        report.append({"replica": choice, "matched_blocks": best})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
