// Regenerates the reference vectors of the hand-made SentencePiece tokenizers and the
// extra chat cases, with Hugging Face's own JS implementations (the same versions that
// produced ../shared/tokenizers/*/vectors.jsonl):
//
//   npm install @huggingface/tokenizers@0.2.0 @huggingface/jinja@0.5.11
//   NODE_PATH=$PWD/node_modules node tokenizer/testdata/refvectors.mjs tokenizer/testdata
//
// Output: sentencepiece/{llama2,metaspace}/vectors.jsonl and tools/{qwen3,llama-3.1}.jsonl.
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
