"""Writes two small hand-made SentencePiece-style tokenizer.json files for tests.

Run: python3 gen.py   (deterministic; no dependencies)

The vocabulary and merges come from a toy BPE trained here on CORPUS, with the
conventions of Llama-2/Mistral files: <unk>, <s>, </s>, then the 256 byte-fallback
tokens <0x00>..<0xFF>, then characters and merges over "▁"-marked words.
"""
import collections
import json

CORPUS = """the quick brown fox jumps over the lazy dog. hello world, hello there!
the router routes requests to the instance that holds the prefix in its cache.
tokens are the units the model sees; blocks hold sixteen tokens each."""
NUM_MERGES = 120
SP = "\u2581"

words = collections.Counter()
for line in CORPUS.split("\n"):
    for w in line.split(" "):
        if w:
            words[SP + w] += 1

vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for b in range(256):
    vocab["<0x%02X>" % b] = len(vocab)
for ch in sorted({c for w in words for c in w}):
    vocab.setdefault(ch, len(vocab))

splits = {w: list(w) for w in words}
merges = []
for _ in range(NUM_MERGES):
    pairs = collections.Counter()
    for w, n in words.items():
        s = splits[w]
        for a, b in zip(s, s[1:]):
            pairs[(a, b)] += n
    if not pairs:
        break
    (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
    merges.append(a + " " + b)
    vocab.setdefault(a + b, len(vocab))
    for w in words:
        s, out, i = splits[w], [], 0
        while i < len(s):
            if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                out.append(a + b)
                i += 2
            else:
                out.append(s[i])
                i += 1
        splits[w] = out


def added(i, c):
    return {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def model():
    return {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
            "ignore_merges": False, "vocab": vocab, "merges": merges}


common = {"version": "1.0", "truncation": None, "padding": None,
          "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")],
          "post_processor": None}

# Llama-2 style: Prepend + Replace normalizers, no pre-tokenizer.
llama2 = dict(common)
llama2["normalizer"] = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": SP},
    {"type": "Replace", "pattern": {"String": " "}, "content": SP}]}
llama2["pre_tokenizer"] = None
llama2["decoder"] = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": SP}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
llama2["model"] = model()
llama2["post_processor"] = {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
             {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}

# Mistral / newer style: Metaspace pre-tokenizer (prepend_scheme "first", split false).
metaspace = dict(common)
metaspace["normalizer"] = None
metaspace["pre_tokenizer"] = {"type": "Metaspace", "replacement": SP, "prepend_scheme": "first", "split": False}
metaspace["decoder"] = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": SP}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
metaspace["model"] = model()

config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
          "chat_template": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"}

for name, tj in (("llama2", llama2), ("metaspace", metaspace)):
    import os
    os.makedirs(name, exist_ok=True)
    with open(name + "/tokenizer.json", "w") as f:
        json.dump(tj, f, ensure_ascii=False, indent=1)
    with open(name + "/tokenizer_config.json", "w") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
print(len(vocab), "tokens,", len(merges), "merges")
