// Client side of bench/server_bench.sh and bench/server_soak.sh (Node 20, no
// packages: node:http + SSE by hand).
//   node server_bench.mjs ttft URL HISTORY_FILE   -> time to first token of turn 2
//   node server_bench.mjs throughput URL CLIENTS REQUESTS MAX_TOKENS
//   node server_bench.mjs soak URL CLIENTS REQUESTS MAX_TOKENS  -> see soak() below
//   node server_bench.mjs streaming URL CLIENTS REQUESTS MAX_TOKENS
//     -> aggregate tokens/s, time-to-first-token and inter-token latency
//        percentiles over CLIENTS concurrent streaming clients
const [mode, url, ...rest] = process.argv.slice(2);

// node:http rather than fetch: fetch's web streams cost the client several
// times the CPU per event, and on a small machine the client's CPU is taken
// from the server it measures (bench/NOTES.md, "Session 24").
const http = await import("node:http");
const agent = new http.Agent({ keepAlive: true });
function post(path, body) {
  return new Promise((resolve, reject) => {
    const data = JSON.stringify(body);
    const req = http.request(new URL(path, url), {
      method: "POST", agent,
      headers: { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(data) },
    }, resolve);
    req.on("error", reject);
    req.end(data);
  });
}
async function readAll(res) {
  res.setEncoding("utf8");
  let s = "";
  for await (const part of res) s += part;
  return s;
}

async function chat(body) {
  const t0 = performance.now();
  const r = await post("/v1/chat/completions", body);
  if (r.statusCode !== 200) throw new Error(`HTTP ${r.statusCode}: ${await readAll(r)}`);
  if (!body.stream) return { json: JSON.parse(await readAll(r)), seconds: (performance.now() - t0) / 1000 };
  let buf = "", ttft = null, text = "", usage = null, last = null;
  const gaps = [];  // seconds between successive content events (one token each, but for held-back UTF-8)
  r.setEncoding("utf8");
  await new Promise((resolve, reject) => {
    r.on("data", (part) => {
      buf += part;
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
        const j = JSON.parse(ev.slice(6));
        if (j.usage) usage = j.usage;
        // A token shows as content, reasoning (after <think>) or a tool call's
        // delta; an answer that is only the end token shows as the finish.
        const ch = j.choices[0], d = ch?.delta ?? {};
        const c = d.content || d.reasoning_content || (d.tool_calls ? JSON.stringify(d.tool_calls) : "");
        if (ttft === null && !c && ch?.finish_reason) ttft = (performance.now() - t0) / 1000;
        if (c) {
          const now = performance.now();
          if (ttft === null) ttft = (now - t0) / 1000; else gaps.push((now - last) / 1000);
          last = now;
          text += c;
        }
      }
    });
    r.on("end", resolve);
    r.on("error", reject);
  });
  return { ttft, text, usage, gaps, seconds: (performance.now() - t0) / 1000 };
}

if (mode === "ttft") {
  const fs = await import("node:fs");
  const history = fs.readFileSync(rest[0], "utf8");
  const msgs = [{ role: "system", content: "You review this code:\n" + history },
                { role: "user", content: "What does the generate function do?" }];
  const ttfts = [];
  for (let rep = 0; rep < 3; rep++) {
    // A fresh conversation each time (the seed in the question makes it new).
    const m = [{ ...msgs[0], content: msgs[0].content + `\n# review ${rep} ${Date.now()}` }, msgs[1]];
    const t1 = await chat({ messages: m, max_tokens: 64, temperature: 0 });
    m.push({ role: "assistant", content: t1.json.choices[0].message.content });
    m.push({ role: "user", content: "And how does it stop?" });
    const t2 = await chat({ messages: m, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } });
    ttfts.push(t2.ttft);
    console.log(`rep ${rep}: turn 1 ${t1.json.usage.prompt_tokens} prompt tokens in ${t1.seconds.toFixed(3)} s; ` +
                `turn 2 ${t2.usage.prompt_tokens} prompt tokens (${t2.usage.prompt_tokens_details.cached_tokens} cached), ` +
                `first token after ${(t2.ttft * 1000).toFixed(1)} ms`);
  }
  ttfts.sort((a, b) => a - b);
  console.log(`turn-2 TTFT median ${(ttfts[1] * 1000).toFixed(1)} ms`);
} else if (mode === "throughput") {
  const [clients, requests, maxTokens] = rest.map(Number);
  let tokens = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: clients }, async (_, c) => {
    for (let i = 0; i < requests; i++) {
      const r = await chat({ messages: [{ role: "user", content: `Client ${c} request ${i}: write a sorting function.` }],
                             max_tokens: maxTokens, temperature: 0.7, seed: c * 1000 + i, ignore_eos: true });
      tokens += r.json.usage.completion_tokens;
    }
  }));
  const s = (performance.now() - t0) / 1000;
  console.log(`${clients} clients: ${tokens} tokens in ${s.toFixed(2)} s = ${(tokens / s).toFixed(1)} generated tokens/s total`);
} else if (mode === "streaming") {
  // TEMPERATURE (optional, default 0.7): 0 is greedy, which the server
  // decodes by the argmax alone (as `flashmoe bench --batch`).
  const [clients, requests, maxTokens] = rest.map(Number);
  const temperature = rest.length > 3 ? Number(rest[3]) : 0.7;
  let tokens = 0;
  const ttfts = [], gaps = [];
  const t0 = performance.now();
  await Promise.all(Array.from({ length: clients }, async (_, c) => {
    for (let i = 0; i < requests; i++) {
      const r = await chat({ messages: [{ role: "user", content: `Client ${c} request ${i}: write a sorting function.` }],
                             max_tokens: maxTokens, temperature, seed: c * 1000 + i, ignore_eos: true,
                             stream: true, stream_options: { include_usage: true } });
      tokens += r.usage.completion_tokens;
      ttfts.push(r.ttft);
      gaps.push(...r.gaps);
    }
  }));
  const s = (performance.now() - t0) / 1000;
  const pct = (v, p) => { const a = [...v].sort((x, y) => x - y); return a[Math.min(a.length - 1, Math.floor(p * a.length))]; };
  const ms = (x) => (x * 1000).toFixed(1);
  console.log(`${clients} streaming clients (temperature ${temperature}): ${tokens} tokens in ${s.toFixed(2)} s = ${(tokens / s).toFixed(1)} tokens/s ` +
              `aggregate; TTFT p50 ${ms(pct(ttfts, 0.5))} / p90 ${ms(pct(ttfts, 0.9))} / p99 ${ms(pct(ttfts, 0.99))} ms; ` +
              `inter-token p50 ${ms(pct(gaps, 0.5))} / p90 ${ms(pct(gaps, 0.9))} / p99 ${ms(pct(gaps, 0.99))} ms`);
} else if (mode === "soak") {
  const { soak } = await import("./server_soak.mjs");
  const [clients, requests, maxTokens] = rest.map(Number);
  process.exitCode = await soak(url, clients, requests, maxTokens);
} else {
  console.error("usage: server_bench.mjs ttft URL HISTORY_FILE | throughput|soak URL CLIENTS REQUESTS MAX_TOKENS | streaming URL CLIENTS REQUESTS MAX_TOKENS [TEMPERATURE]");
  process.exit(2);
}
