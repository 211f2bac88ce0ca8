#!/usr/bin/env python3
"""Writes docs/benchmarks/traces/handwritten-diurnal-mixed.jsonl.gz (session 20, 2026-12-06).

A Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length,
hash_ids; 512 tokens per hash id) written by hand for this project, before any
run, to try kvbench on traffic the routing rule was not developed against and
that the synthesiser cannot express (docs/kvbench.md, "Synthesised traces"):

- a compressed day: new sessions arrive as a Poisson process whose rate swings
  from 0.2x to 2x its base (2/s) and back over 600 s (sin^2), so the fleet
  goes from idle to its peak and back inside one run;
- a bimodal mix of long and short prompts, and short prompts with long
  outputs (decode-heavy), in one fleet:
  * 55 % short chats: one of 4 system prompts (2 blocks) plus 0-2 blocks of
    question; outputs 300-2,000 tokens; follow-up with probability 0.6,
    1-2 blocks appended, the user thinking 5-60 s;
  * 30 % questions on one of 20 long documents (30-200 blocks, Zipf(1.1)
    popularity) plus a 1-block question; outputs 50-250 tokens; follow-up
    with probability 0.3, 1 block appended, 10-90 s later;
  * 15 % cold long prompts (pasted code or logs, 20-100 blocks of their own);
    outputs 100-500 tokens; follow-up with probability 0.3, 1-3 blocks,
    10-90 s later.
  A prompt is capped at 250 blocks (128,000 tokens, under the simulated
  engine's 131,072-token limit); a longer follow-up ends the session.

Hash ids are assigned per distinct block prefix, as Mooncake's are (equal ids
mean an equal prefix up to that block). Deterministic (seed 20). Python 3
standard library only. Usage: python3 scripts/handwritten-diurnal-mixed.py OUT.jsonl.gz
"""
import gzip
import heapq
import json
import math
import random
import sys

SEED, DAY_S, BASE_RATE, MAX_BLOCKS = 20, 600.0, 2.0, 250


def main(out_path):
    rng = random.Random(SEED)
    ids = {}  # (parent id, block label) -> hash id

    def hash_ids(labels):
        out, parent = [], -1
        for lab in labels:
            key = (parent, lab)
            if key not in ids:
                ids[key] = len(ids)
            parent = ids[key]
            out.append(parent)
        return out

    docs = [rng.randint(30, 200) for _ in range(20)]
    doc_w = [1 / (k + 1) ** 1.1 for k in range(len(docs))]
    uniq = [0]

    def fresh(n):
        uniq[0] += 1
        return [("u", uniq[0], j) for j in range(n)]

    events = []  # (time s, seq, labels, kind)
    seq = 0
    # New sessions: thinned Poisson process with rate BASE_RATE * (0.2 + 1.8 sin^2(pi t / DAY)).
    t, peak = 0.0, 2.0 * BASE_RATE
    while True:
        t += rng.expovariate(peak)
        if t >= DAY_S:
            break
        if rng.random() > (0.2 + 1.8 * math.sin(math.pi * t / DAY_S) ** 2) / 2.0:
            continue
        u = rng.random()
        if u < 0.55:
            kind = "chat"
            labels = [("sys", rng.randrange(4), j) for j in range(2)] + fresh(rng.randint(0, 2))
        elif u < 0.85:
            kind = "doc"
            d = rng.choices(range(len(docs)), weights=doc_w)[0]
            labels = [("doc", d, j) for j in range(docs[d])] + fresh(1)
        else:
            kind = "cold"
            labels = fresh(rng.randint(20, 100))
        heapq.heappush(events, (t, seq, labels, kind))
        seq += 1

    out = []
    while events:
        t, _, labels, kind = heapq.heappop(events)
        if len(labels) > MAX_BLOCKS:
            continue
        if kind == "chat":
            olen = rng.randint(300, 2000)
        elif kind == "doc":
            olen = rng.randint(50, 250)
        else:
            olen = rng.randint(100, 500)
        hids = hash_ids(labels)
        out.append({"timestamp": int(t * 1000), "input_length": len(hids) * 512 - rng.randint(0, 511),
                    "output_length": olen, "hash_ids": hids})
        # The reply joins the history as tokens the engine did not produce
        # in this prompt's blocks: the next turn keeps the prompt's full
        # blocks (all but the partial last, which is replaced) and appends.
        p = {"chat": 0.6, "doc": 0.3, "cold": 0.3}[kind]
        if rng.random() < p:
            if kind == "chat":
                gap, add = rng.uniform(5, 60), rng.randint(1, 2)
            elif kind == "doc":
                gap, add = rng.uniform(10, 90), 1
            else:
                gap, add = rng.uniform(10, 90), rng.randint(1, 3)
            nxt = labels[:-1] + fresh(add + 1)
            heapq.heappush(events, (t + gap, seq, nxt, kind))
            seq += 1
    out.sort(key=lambda r: r["timestamp"])
    with gzip.open(out_path, "wt") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    print(f"{len(out)} requests, {out[-1]['timestamp'] / 1000:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
