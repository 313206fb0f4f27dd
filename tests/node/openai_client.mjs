// Drives `flashmoe serve` with the official openai package: models, plain and
// streamed chat, plain completions, and an error mapped to the SDK's class.
import OpenAI from "openai";
import { startServer, runTests } from "./serve.mjs";
import assert from "node:assert/strict";

const [bin, modelDir] = process.argv.slice(2);
const key = "node-test-key";


const { proc, port } = await startServer(bin, ["-m", modelDir, "--api-key", key, "--parallel", "2", "-t", "2"]);
const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: key, maxRetries: 0 });
const tests = [];
const test = (name, fn) => tests.push({ name, fn });
const messages = [{ role: "user", content: "Write a Python function that returns the square of x." }];

test("models.list", async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.deepEqual(ids, ["coder-mini"]);
});

let plain = "";
test("chat.completions.create", async () => {
  const r = await client.chat.completions.create({ model: "coder-mini", messages, max_tokens: 24, temperature: 0 });
  assert.equal(r.object, "chat.completion");
  assert.equal(r.choices[0].message.role, "assistant");
  plain = r.choices[0].message.content;
  assert.ok(typeof plain === "string" && plain.length > 0);
  assert.ok(["stop", "length"].includes(r.choices[0].finish_reason));
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
});

test("chat.completions.create stream", async () => {
  const stream = await client.chat.completions.create({
    model: "coder-mini", messages, max_tokens: 24, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  let text = "", finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    const c = chunk.choices[0];
    if (!c) continue;
    if (c.delta?.content) text += c.delta.content;
    if (c.finish_reason) finish = c.finish_reason;
  }
  assert.ok(chunks >= 3);
  assert.equal(text, plain);
  assert.ok(finish === "stop" || finish === "length");
  assert.ok(usage && usage.completion_tokens > 0);
});

test("completions.create", async () => {
  const r = await client.completions.create({ model: "coder-mini", prompt: "def add(a, b):\n", max_tokens: 16, temperature: 0 });
  assert.equal(r.object, "text_completion");
  assert.equal(typeof r.choices[0].text, "string");
});

test("unknown model is a BadRequestError", async () => {
  await assert.rejects(
    client.chat.completions.create({ model: "gpt-4o", messages, max_tokens: 4 }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.code === "model_not_found");
});

test("wrong key is an AuthenticationError", async () => {
  const bad = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: "wrong", maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
});

test("response_format json_schema: the answer parses and matches", async () => {
  const schema = {
    type: "object",
    properties: { name: { type: "string", maxLength: 12 }, tags: { type: "array", items: { enum: ["a", "b"] }, maxItems: 2 } },
    required: ["name", "tags"], additionalProperties: false,
  };
  const r = await client.chat.completions.create({
    model: "coder-mini", messages, max_tokens: 48, temperature: 0,
    response_format: { type: "json_schema", json_schema: { name: "item", schema, strict: true } },
  });
  assert.equal(r.choices[0].finish_reason, "stop");
  const v = JSON.parse(r.choices[0].message.content);
  assert.deepEqual(Object.keys(v), ["name", "tags"]);
  assert.ok(typeof v.name === "string" && [...v.name].length <= 12);
  assert.ok(Array.isArray(v.tags) && v.tags.length <= 2 && v.tags.every((t) => t === "a" || t === "b"));
  await assert.rejects(
    client.chat.completions.create({ model: "coder-mini", messages, max_tokens: 4,
      response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "string", pattern: "^a" } } } }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "response_format" && /'pattern'/.test(e.message));
});

await runTests(tests, proc);
