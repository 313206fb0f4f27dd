// Server soak client (run through `node bench/server_bench.mjs soak ...`, driven
// by bench/server_soak.sh). CLIENTS concurrent clients send REQUESTS requests
// in all, a fixed mix per 20:
//   4 chat, non-streaming, new conversation   3 chat, streaming (include_usage)
//   2 completions, non-streaming               2 completions, streaming
//   4 chat turns extending the client's own conversation (snapshot reuse;
//     a conversation restarts after 6 turns), streaming and not in turn
//   1 chat stream the client aborts after the first content chunk
//   3 bad requests that must get their 4xx     1 GET /v1/models, /health or /metrics
// Every valid request must succeed and be well formed (status 200, shape,
// usage within max_tokens, SSE ending in a finish chunk and [DONE]); every
// bad one must get exactly its expected status and an OpenAI-style error
// body. New-conversation requests reuse a small set of seeded prompts, so the
// same request is sent many times: its answer must be the same every time
// (whichever slot, snapshot or interleaving produced it). Returns the exit code.

const TOPICS = ["a sorting function", "a binary search", "a class for a stack", "a function that reads a CSV file",
                "a memoized fibonacci", "a context manager", "a unit test", "a dataclass for a point",
                "a function that merges two dicts", "a generator of primes"];
const FOLLOW = ["Add type hints.", "Now write a docstring.", "Make it faster.", "Add error handling.",
                "Write a test for it.", "Explain it in one line."];

// Bad requests and the status each must get.
function badRequests(model) {
  const chat = "/v1/chat/completions", cmpl = "/v1/completions";
  const msgs = [{ role: "user", content: "hi" }];
  return [
    { name: "invalid JSON", path: chat, raw: "{\"messages\": [", status: 400 },
    { name: "body not an object", path: chat, raw: "[1, 2]", status: 400 },
    { name: "invalid UTF-8", path: cmpl, rawBytes: Buffer.from([0x7b, 0x22, 0x70, 0x72, 0x6f, 0x6d, 0x70, 0x74, 0x22, 0x3a, 0x22, 0xff, 0xfe, 0x22, 0x7d]), status: 400 },
    { name: "messages missing", path: chat, body: { max_tokens: 4 }, status: 400 },
    { name: "messages empty", path: chat, body: { messages: [] }, status: 400 },
    { name: "bad role", path: chat, body: { messages: [{ role: "robot", content: "x" }] }, status: 400 },
    { name: "content not text", path: chat, body: { messages: [{ role: "user", content: [{ type: "image_url" }] }] }, status: 400 },
    { name: "wrong model", path: chat, body: { model: model + "-nope", messages: msgs }, status: 400 },
    { name: "max_tokens 0", path: chat, body: { messages: msgs, max_tokens: 0 }, status: 400 },
    { name: "temperature 5", path: chat, body: { messages: msgs, temperature: 5 }, status: 400 },
    { name: "n = 2", path: chat, body: { messages: msgs, n: 2 }, status: 400 },
    { name: "5 stop strings", path: chat, body: { messages: msgs, stop: ["a", "b", "c", "d", "e"] }, status: 400 },
    { name: "stream not boolean", path: chat, body: { messages: msgs, stream: "yes" }, status: 400 },
    { name: "empty prompt", path: cmpl, body: { prompt: "" }, status: 400 },
    { name: "prompt a number", path: cmpl, body: { prompt: 42 }, status: 400 },
    { name: "prompt over the context", path: cmpl, body: { prompt: "x = 1\n".repeat(1500) }, status: 400,
      code: "context_length_exceeded" },
    { name: "body over --max-body", path: cmpl, body: { prompt: "y".repeat(300 * 1024) }, status: 413 },
    { name: "unknown route", path: "/v1/nope", body: { prompt: "x" }, status: 404 },
    { name: "unknown model GET", get: "/v1/models/nope", status: 404 },
    { name: "GET on a POST route", get: "/v1/completions", status: 404, anyOf: [404, 405] },
  ];
}

export async function soak(url, clients, requests, maxTokens) {
  const models = await (await fetch(`${url}/v1/models`)).json();
  const model = models.data[0].id;
  const bad = badRequests(model);
  const stats = { ok: 0, failed: 0, bad_ok: 0, bad_failed: 0, cancelled: 0, tokens: 0, reused_turns: 0,
                  continued_turns: 0, repeats_checked: 0, by_kind: {} };
  const failures = [];
  const answers = new Map();  // seeded request key -> answer text
  let next = 0;
  const t0 = performance.now();
  const fail = (kind, msg) => { stats.failed++; if (failures.length < 20) failures.push(`${kind}: ${msg}`); };
  const count = (kind) => { stats.by_kind[kind] = (stats.by_kind[kind] || 0) + 1; };

  async function post(path, body, { abortAfterFirst = false } = {}) {
    const ctl = new AbortController();
    const r = await fetch(`${url}${path}`, { method: "POST", headers: { "Content-Type": "application/json" },
                                             body: JSON.stringify(body), signal: ctl.signal });
    if (r.status !== 200) return { status: r.status, error: await r.text() };
    if (!body.stream) return { status: 200, json: await r.json() };
    const dec = new TextDecoder();
    let buf = "", text = "", usage = null, finish = null, done = false, chunks = 0, afterDone = false;
    try {
      for await (const part of r.body) {
        buf += dec.decode(part, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const ev = buf.slice(0, i); buf = buf.slice(i + 2);
          if (!ev.startsWith("data: ")) throw new Error(`bad SSE event ${JSON.stringify(ev.slice(0, 80))}`);
          if (done) afterDone = true;
          if (ev === "data: [DONE]") { done = true; continue; }
          const j = JSON.parse(ev.slice(6));
          if (j.error) throw new Error(`error event ${JSON.stringify(j.error)}`);
          if (j.usage) usage = j.usage;
          const c = j.choices[0];
          if (!c) continue;
          const piece = body.messages ? c.delta?.content : c.text;
          if (piece) { text += piece; chunks++; }
          if (c.finish_reason) finish = c.finish_reason;
          if (abortAfterFirst && chunks > 0) { ctl.abort(); return { status: 200, aborted: true }; }
        }
      }
    } catch (e) {
      if (abortAfterFirst && e.name === "AbortError") return { status: 200, aborted: true };
      throw e;
    }
    return { status: 200, stream: { text, usage, finish, done, afterDone } };
  }

  // Checks a 200 answer; returns { text, usage } or throws.
  function check(r, body) {
    if (r.status !== 200) throw new Error(`HTTP ${r.status}: ${r.error}`);
    const limit = body.max_tokens;
    let text, usage, finish;
    if (r.json) {
      const c = r.json.choices?.[0];
      if (r.json.object !== (body.messages ? "chat.completion" : "text_completion")) throw new Error(`object ${r.json.object}`);
      text = body.messages ? c?.message?.content : c?.text;
      usage = r.json.usage; finish = c?.finish_reason;
    } else {
      const s = r.stream;
      if (!s.done) throw new Error("stream ended without [DONE]");
      if (s.afterDone) throw new Error("events after [DONE]");
      text = s.text; usage = s.usage; finish = s.finish;
      if (!usage) throw new Error("no usage chunk (include_usage was set)");
    }
    if (typeof text !== "string") throw new Error("no text");
    if (finish !== "stop" && finish !== "length") throw new Error(`finish_reason ${finish}`);
    const n = usage?.completion_tokens;
    if (!(n >= 1 && n <= limit)) throw new Error(`completion_tokens ${n} outside 1..${limit}`);
    if (finish === "length" && n !== limit) throw new Error(`finish length after ${n} of ${limit} tokens`);
    if (usage.total_tokens !== usage.prompt_tokens + n) throw new Error("usage does not add up");
    stats.tokens += n;
    return { text, usage };
  }

  async function one(c, i, conv) {
    const slot = i % 20;
    const mt = 4 + (i * 7) % (maxTokens - 3);  // 4..maxTokens
    if (slot < 4 || (slot >= 4 && slot < 7)) {  // chat, new conversation, seeded: must repeat exactly
      const k = i % 23;
      const stream = slot >= 4;
      const body = { messages: [{ role: "user", content: `Write ${TOPICS[k % TOPICS.length]} (${k}).` }],
                     max_tokens: 4 + (k % (maxTokens - 3)), temperature: 0.8, seed: k, stream };
      if (stream) body.stream_options = { include_usage: true };
      const kind = stream ? "chat stream" : "chat";
      count(kind);
      const { text } = check(await post("/v1/chat/completions", body), body);
      const key = `chat ${k}`;
      if (answers.has(key)) {
        stats.repeats_checked++;
        if (answers.get(key) !== text) throw new Error(`seeded request ${k} answered differently: ` +
                                                       `${JSON.stringify(answers.get(key))} vs ${JSON.stringify(text)}`);
      } else answers.set(key, text);
    } else if (slot < 11) {  // completions
      const stream = slot >= 9;
      const body = { prompt: `# ${TOPICS[i % TOPICS.length]}\ndef f${i % 50}(`, max_tokens: mt, temperature: 0.7,
                     seed: i, stream };
      if (stream) body.stream_options = { include_usage: true };
      count(stream ? "completions stream" : "completions");
      check(await post("/v1/completions", body), body);
    } else if (slot < 15) {  // extend this client's conversation
      if (conv.messages.length === 0 || conv.turns >= 6) {
        conv.messages = [{ role: "system", content: `You are client ${c}'s Python helper.` },
                         { role: "user", content: `Write ${TOPICS[(c + i) % TOPICS.length]}.` }];
        conv.turns = 0;
      } else {
        conv.messages.push({ role: "user", content: FOLLOW[conv.turns % FOLLOW.length] });
      }
      const stream = i % 2 === 0;
      const body = { messages: conv.messages, max_tokens: mt, temperature: 0.7, seed: i, stream };
      if (stream) body.stream_options = { include_usage: true };
      count("chat turn");
      const { text, usage } = check(await post("/v1/chat/completions", body), body);
      if (conv.turns > 0) {
        stats.continued_turns++;
        if (usage.prompt_tokens_details?.cached_tokens > 0) stats.reused_turns++;
      }
      conv.messages.push({ role: "assistant", content: text });
      conv.turns++;
    } else if (slot === 15) {  // a stream the client walks away from
      const body = { messages: [{ role: "user", content: `Write ${TOPICS[i % TOPICS.length]}.` }],
                     max_tokens: maxTokens, temperature: 0.7, seed: i, stream: true, ignore_eos: true };
      count("aborted stream");
      const r = await post("/v1/chat/completions", body, { abortAfterFirst: true });
      if (r.status !== 200) throw new Error(`HTTP ${r.status}: ${r.error}`);
      if (r.aborted) stats.cancelled++;
      return "valid";
    } else if (slot < 19) {  // bad request
      const b = bad[(Math.floor(i / 20) * 3 + slot - 16) % bad.length];
      count("bad request");
      let r;
      if (b.get) r = await fetch(`${url}${b.get}`);
      else r = await fetch(`${url}${b.path}`, { method: "POST", headers: { "Content-Type": "application/json" },
                                                body: b.rawBytes ?? b.raw ?? JSON.stringify(b.body) });
      const txt = await r.text();
      const want = b.anyOf ?? [b.status];
      if (!want.includes(r.status)) throw new Error(`bad request '${b.name}': HTTP ${r.status}, want ${want}: ${txt.slice(0, 200)}`);
      let j;
      try { j = JSON.parse(txt); } catch { throw new Error(`bad request '${b.name}': error body is not JSON: ${txt.slice(0, 200)}`); }
      if (typeof j.error?.message !== "string") throw new Error(`bad request '${b.name}': no error.message`);
      if (b.code && j.error.code !== b.code) throw new Error(`bad request '${b.name}': code ${j.error.code}, want ${b.code}`);
      return "bad";
    } else {  // cheap GETs
      const path = ["/v1/models", "/health", "/metrics"][Math.floor(i / 20) % 3];
      count("GET");
      const r = await fetch(`${url}${path}`);
      const txt = await r.text();
      if (r.status !== 200) throw new Error(`GET ${path}: HTTP ${r.status}`);
      if (path === "/metrics" && !txt.includes("flashmoe_")) throw new Error("metrics without flashmoe_ lines");
    }
    return "valid";
  }

  let lastReport = performance.now();
  await Promise.all(Array.from({ length: clients }, async (_, c) => {
    const conv = { messages: [], turns: 0 };
    for (;;) {
      const i = next++;
      if (i >= requests) return;
      const isBad = i % 20 >= 16 && i % 20 < 19;
      try {
        await one(c, i, conv);
        if (isBad) stats.bad_ok++; else stats.ok++;
      } catch (e) {
        if (isBad) { stats.bad_failed++; if (failures.length < 20) failures.push(`request ${i}: ${e.message}`); }
        else fail(`request ${i}`, e.message);
        if (!isBad && i % 20 >= 11 && i % 20 < 15) conv.messages = [];  // do not build on a failed turn
      }
      const now = performance.now();
      if (now - lastReport > 30000) {
        lastReport = now;
        console.log(`soak: ${i + 1}/${requests} requests after ${((now - t0) / 1000).toFixed(0)} s ` +
                    `(${stats.failed + stats.bad_failed} failures so far)`);
      }
    }
  }));
  const s = (performance.now() - t0) / 1000;
  console.log(`soak: ${requests} requests from ${clients} clients in ${s.toFixed(1)} s ` +
              `(${(requests / s).toFixed(1)} req/s, ${stats.tokens} completion tokens)`);
  console.log(`soak: valid requests ok ${stats.ok}, failed ${stats.failed} ` +
              `(${stats.cancelled} streams aborted by the client mid-way)`);
  console.log(`soak: bad requests answered with the expected 4xx ${stats.bad_ok}, wrong answer ${stats.bad_failed}`);
  console.log(`soak: conversation turns that extended an earlier one ${stats.continued_turns}, ` +
              `started from a snapshot ${stats.reused_turns}; seeded repeats identical ${stats.repeats_checked}`);
  console.log(`soak: by kind ${JSON.stringify(stats.by_kind)}`);
  for (const f of failures) console.log(`soak: FAIL ${f}`);
  return stats.failed + stats.bad_failed === 0 ? 0 : 1;
}
