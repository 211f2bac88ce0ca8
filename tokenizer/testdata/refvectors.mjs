// Regenerates the reference vectors of the hand-made SentencePiece tokenizers and the
// extra chat cases, with Hugging Face's own JS implementations (the same versions that
// produced the brief's shared/tokenizers/*/vectors.jsonl, copied to tokenizer/testdata/*/vectors.jsonl):
//
//   npm install @huggingface/tokenizers@0.2.0 @huggingface/jinja@0.5.11
//   NODE_PATH=$PWD/node_modules node tokenizer/testdata/refvectors.mjs tokenizer/testdata
//
// Output: sentencepiece/{llama2,metaspace}/vectors.jsonl, tools/{qwen3,llama-3.1}.jsonl,
// unicode.jsonl (1,000 pseudo-random strings over characters where regex engines differ),
// tools/features.jsonl (template features) and specials.jsonl (add_special_tokens=true, what
// vLLM applies to /v1/completions prompts).
import fs from "node:fs";
import zlib from "node:zlib";
import path from "node:path";
import { createRequire } from "node:module";
const require = createRequire(process.env.NODE_PATH + "/");
const { Tokenizer } = require("@huggingface/tokenizers");
const { Template } = require("@huggingface/jinja");

const dir = process.argv[2];
const readJSON = (p) => JSON.parse(p.endsWith(".gz") ? zlib.gunzipSync(fs.readFileSync(p)).toString() : fs.readFileSync(p, "utf8"));

const spTexts = [
  "", "hello world", "the quick brown fox", " leading space", "trailing space ", "two  spaces",
  "hello\nworld", "tabs\tand\ttabs", "café déjà vu", "emoji 😀 here", "中文 text", "<s>hello</s> world",
  "unknownwords zzz qqq", "the router routes requests.", "Hello World", "x",
];
for (const name of ["llama2", "metaspace"]) {
  const base = path.join(dir, "sentencepiece", name);
  const tok = new Tokenizer(readJSON(path.join(base, "tokenizer.json")), readJSON(path.join(base, "tokenizer_config.json")));
  const cfg = readJSON(path.join(base, "tokenizer_config.json"));
  const tmpl = new Template(cfg.chat_template);
  const lines = spTexts.map((text) => JSON.stringify({ text, ids: tok.encode(text, { add_special_tokens: false }).ids }));
  for (const messages of [
    [{ role: "user", content: "hello world" }],
    [{ role: "user", content: "hello" }, { role: "assistant", content: "hello there" }, { role: "user", content: "the fox?" }],
  ]) {
    const rendered = tmpl.render({ messages, add_generation_prompt: true, bos_token: cfg.bos_token, eos_token: cfg.eos_token });
    lines.push(JSON.stringify({ messages, add_generation_prompt: true, rendered, ids: tok.encode(rendered, { add_special_tokens: false }).ids }));
  }
  fs.writeFileSync(path.join(base, "vectors.jsonl"), lines.join("\n") + "\n");
}

// Chat cases the shared vectors do not cover: tools, tool calls, tool results, thinking.
const tools = [{ type: "function", function: { name: "get_weather", description: "Get the weather for a city.",
  parameters: { type: "object", properties: { city: { type: "string", description: "City name" }, unit: { type: "string", enum: ["c", "f"] } }, required: ["city"] } } }];
const cases = [
  { messages: [{ role: "system", content: "You are terse." }, { role: "user", content: "Weather in Paris?" }], tools, add_generation_prompt: true },
  { messages: [{ role: "user", content: "Weather in Paris?" },
      { role: "assistant", content: "", tool_calls: [{ id: "c1", type: "function", function: { name: "get_weather", arguments: { city: "Paris", unit: "c" } } }] },
      { role: "tool", tool_call_id: "c1", content: "{\"temp\": 21}" },
      { role: "tool", tool_call_id: "c2", content: "sunny" }], tools, add_generation_prompt: true },
  { messages: [{ role: "user", content: "2+2?" }, { role: "assistant", content: "<think>\nsmall sum\n</think>\n\n4" }, { role: "user", content: "and 3+3?" }], add_generation_prompt: true },
  { messages: [{ role: "user", content: "hi" }], add_generation_prompt: true, enable_thinking: false },
  { messages: [{ role: "user", content: "hi" }, { role: "assistant", content: "hello", reasoning_content: "greet back" }], add_generation_prompt: false },
];
for (const name of ["qwen3", "llama-3.1"]) {
  const base = path.join(dir, name);
  const cfg = readJSON(path.join(base, "tokenizer_config.json"));
  const tok = new Tokenizer(readJSON(path.join(base, "tokenizer.json.gz")), cfg);
  const tmpl = new Template(cfg.chat_template);
  const lines = cases.map((c) => {
    const rendered = tmpl.render({ ...c, bos_token: cfg.bos_token, eos_token: cfg.eos_token });
    return JSON.stringify({ ...c, rendered, ids: tok.encode(rendered, { add_special_tokens: false }).ids });
  });
  fs.writeFileSync(path.join(dir, "tools", name + ".jsonl"), lines.join("\n") + "\n");
}

// Adversarial strings: characters on which regex engines disagree about \s, \p{L}, \p{N}
// and case folding, contractions, specials and their fragments, combining marks.
const pool = ["a", "Z", "é", "ſ", "K", "'", "'s", "'LL", "'Re", " ", "  ", "\t", "\n", "\r\n", "\u0085", "\u00a0",
  "\ufeff", "\u2028", "\u3000", "\u200b", "1", "23", "456", "½", "²", "٣", "Ⅻ", "!", "...", "<|im_start|>",
  "<|eot_id|>", "<think>", "😀", "👍🏽", "中", "文", "ｆ", "e\u0301", "A\u030a", "한", "\u0000", "\u001f", "_", "-",
  "$", "<|", "|>", "\u1680", "\u180e", "\u205f"];
let seed = 42;
const rnd = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
const texts = [];
for (let i = 0; i < 1000; i++) {
  let s = "";
  const n = 1 + Math.floor(rnd() * 12);
  for (let j = 0; j < n; j++) s += pool[Math.floor(rnd() * pool.length)];
  texts.push(s);
}
const toks = {};
for (const name of ["llama-3.1", "qwen3"]) {
  const base = path.join(dir, name);
  toks[name] = new Tokenizer(readJSON(path.join(base, "tokenizer.json.gz")), readJSON(path.join(base, "tokenizer_config.json")));
}
fs.writeFileSync(path.join(dir, "unicode.jsonl"), texts.map((text) => JSON.stringify({ text,
  "llama-3.1": toks["llama-3.1"].encode(text, { add_special_tokens: false }).ids,
  qwen3: toks.qwen3.encode(text, { add_special_tokens: false }).ids })).join("\n") + "\n");

// Template features real chat templates use, in a template written for this test (it
// iterates content through a variable so that content is passed as sent, as transformers
// does, rather than as vLLM's "openai" content format):
// tojson with indent and separators, items, slicing, "in" on dicts, is mapping/iterable/
// string, trim, namespace, loop variables, string methods, default, raise-free paths.
const featureTemplate = `{{- bos_token }}
{%- set ns = namespace(sys="", n=0) %}
{%- if messages[0]['role'] == 'system' %}{% set ns.sys = messages[0]['content'] | trim %}{% set messages = messages[1:] %}{% endif %}
{{- "[SYS]" + ns.sys + "\\n" }}
{%- if tools is defined and tools is not none %}
{%- for t in tools %}{{ t | tojson(indent=4) }}{{ "\\n" }}{{ t.function.parameters | tojson(separators=(",", ":")) }}{{ "\\n" }}{% endfor %}
{%- endif %}
{%- for message in messages %}
{%- set ns.n = ns.n + 1 %}
{%- if 'tool_calls' in message %}
{%- for tc in message.tool_calls %}{{ tc.function.name }}({% for k, v in tc.function.arguments | items %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}){% endfor %}
{%- elif message.content is string %}
{{- loop.index ~ ":" ~ message.role | upper ~ ":" ~ message.content.strip().replace("\\n", " ") ~ ("" if loop.last else "|") }}
{%- elif message.content is iterable %}
{%- set parts = message.content %}{%- for p in parts %}<{{ p.type }}>{{ p.text | default("") }}{% endfor %}
{%- endif %}
{%- endfor %}
{{- "\\n#" ~ ns.n ~ (" +gen" if add_generation_prompt else "") }}`;
const featureCases = [
  { messages: [{ role: "system", content: "  sys prompt \\n" }, { role: "user", content: "a\\nb  " }, { role: "assistant", content: "ok" }], add_generation_prompt: true, tools },
  { messages: [{ role: "user", content: "call" }, { role: "assistant", content: null, tool_calls: [{ type: "function", function: { name: "f", arguments: { z: 1.5, a: [true, null, "x\u2028y\u0001"], m: { k: 2.0 } } } }] }], add_generation_prompt: false },
  { messages: [{ role: "user", content: "short" }], add_generation_prompt: true },
];
{
  const ft = new Template(featureTemplate);
  const lines = featureCases.map((c) => JSON.stringify({ template: featureTemplate, ...c, rendered: ft.render({ ...c, bos_token: "<s>" }) }));
  fs.writeFileSync(path.join(dir, "tools", "features.jsonl"), lines.join("\n") + "\n");
}

// add_special_tokens=true: the post-processor's template (Llama 3: BOS first; Qwen3: nothing).
{
  const lines = [];
  for (const [name, base, gz] of [["llama-3.1", path.join(dir, "llama-3.1"), true], ["qwen3", path.join(dir, "qwen3"), true],
    ["sentencepiece/llama2", path.join(dir, "sentencepiece", "llama2"), false], ["sentencepiece/metaspace", path.join(dir, "sentencepiece", "metaspace"), false]]) {
    const tok = new Tokenizer(readJSON(path.join(base, gz ? "tokenizer.json.gz" : "tokenizer.json")), readJSON(path.join(base, "tokenizer_config.json")));
    for (const text of ["", "Hello world", "<|begin_of_text|>Hi", "<s>hello</s>", " the fox\n"]) {
      lines.push(JSON.stringify({ model: name, text, ids: tok.encode(text, { add_special_tokens: true }).ids }));
    }
  }
  fs.writeFileSync(path.join(dir, "specials.jsonl"), lines.join("\n") + "\n");
}
