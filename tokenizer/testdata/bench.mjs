// Tokenization throughput of Hugging Face's JS tokenizer on the same corpus as the Go
// BenchmarkEncode (files from GOROOT), for a ratio measured in the same run:
//
//   NODE_PATH=/path/to/node_modules node tokenizer/testdata/bench.mjs tokenizer/testdata $(go env GOROOT)
//
// cold = first encode on a fresh tokenizer instance (its BPE cache empty);
// warm = best of the following passes (cache filled). Throughput is given per wall second
// and per CPU second (process.cpuUsage), since the machine is shared.
import fs from "node:fs";
import zlib from "node:zlib";
import path from "node:path";
import { createRequire } from "node:module";
const require = createRequire(process.env.NODE_PATH + "/");
const { Tokenizer } = require("@huggingface/tokenizers");

const [dir, goroot] = process.argv.slice(2);
const files = ["doc/go_spec.html", "doc/go_mem.html", "doc/godebug.md", "src/net/http/server.go", "src/runtime/proc.go"];
const corpus = files.map((f) => fs.readFileSync(path.join(goroot, f), "utf8")).join("");
const mb = Buffer.byteLength(corpus) / 1e6;
for (const name of ["llama-3.1", "qwen3"]) {
  const tj = JSON.parse(zlib.gunzipSync(fs.readFileSync(path.join(dir, name, "tokenizer.json.gz"))).toString());
  const tc = JSON.parse(fs.readFileSync(path.join(dir, name, "tokenizer_config.json"), "utf8"));
  const tok = new Tokenizer(tj, tc);
  const cpu = () => { const u = process.cpuUsage(); return (u.user + u.system) / 1e6; };
  let t0 = process.hrtime.bigint(), c0 = cpu();
  const ids = tok.encode(corpus, { add_special_tokens: false }).ids;
  const cold = Number(process.hrtime.bigint() - t0) / 1e9, coldCPU = cpu() - c0;
  let warm = Infinity, warmCPU = Infinity;
  for (let i = 0; i < 5; i++) {
    t0 = process.hrtime.bigint(); c0 = cpu();
    tok.encode(corpus, { add_special_tokens: false });
    warm = Math.min(warm, Number(process.hrtime.bigint() - t0) / 1e9);
    warmCPU = Math.min(warmCPU, cpu() - c0);
  }
  const r = (x) => +x.toFixed(3);
  console.log(JSON.stringify({ model: name, bytes: Buffer.byteLength(corpus), tokens: ids.length,
    cold_MBps: r(mb / cold), warm_MBps: r(mb / warm), cold_cpu_MBps: r(mb / coldCPU), warm_cpu_MBps: r(mb / warmCPU) }));
}
