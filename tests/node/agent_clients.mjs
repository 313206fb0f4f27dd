// A whole tool-calling round trip through the official `openai` and
// `@anthropic-ai/sdk` packages, streamed and not, against `flashmoe serve`
// on coder-mini with Qwen3's chat template (--chat-template), which renders
// tools, tool calls and tool results.
//
// Why the model calls the tool here, and why exactly 21 tokens: coder-mini
// is an 18.8M-parameter model trained on Python and a recall (copy) task,
// never on tool use, so left alone it writes Python. The requests therefore
// use tool_choice "required" (Anthropic: {"type": "any"}), a real feature:
// the server ends the prompt with the start of a call, `<tool_call>\n{"name": "`,
// and the model picks the function and writes its arguments. The
// conversation shows it, twice, the exchange "Weather in Paris? -> call
// get_weather {city: Paris} -> tool result -> answer" rendered by the real
// template, and greedy decoding copies the call:
// `get_weather", "arguments": {"city": "Paris"}}\n` is its next 21 tokens
// (measured; after them it drifts back to Python, which would make the
// call's text malformed, hence max_tokens 21). Every tool call this test
// sees is text the model generated and the server parsed; nothing is
// injected (a fake backend would only test the SDKs, not the server). If
// the model or the template changed, the test fails showing what came back.
// The final answers after the tool result are whatever the model writes
// (Python, here): the test checks their shape, not their words.
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";
import { startServer, runTests } from "./serve.mjs";
import assert from "node:assert/strict";

const [bin, modelDir, template] = process.argv.slice(2);
const key = "agent-test-key";


const { proc, port } = await startServer(bin, ["-m", modelDir, "--chat-template", template, "--api-key", key, "--parallel", "2", "-t", "2"]);
const openai = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: key, maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: `http://127.0.0.1:${port}`, apiKey: key, maxRetries: 0 });
const tests = [];
const test = (name, fn) => tests.push({ name, fn });

const QUESTION = "Weather in Paris?";
const RESULT = "sunny";
const ANSWER = "It is sunny in Paris.";
const ARGS = { city: "Paris" };
const weatherTool = {
  type: "function",
  function: { name: "get_weather", description: "Current weather in a city",
              parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } },
};

// The two worked examples, in OpenAI's message shapes.
function examples() {
  const m = [];
  for (let k = 0; k < 2; k++) {
    const id = `call_example${k}`;
    m.push({ role: "user", content: QUESTION });
    m.push({ role: "assistant", content: null,
             tool_calls: [{ id, type: "function", function: { name: "get_weather", arguments: JSON.stringify(ARGS) } }] });
    m.push({ role: "tool", tool_call_id: id, content: RESULT });
    m.push({ role: "assistant", content: ANSWER });
  }
  return m;
}
const common = { model: "coder-mini", tools: [weatherTool], temperature: 0 };
const forced = { ...common, tool_choice: "required", max_tokens: 21 };
const answer = { ...common, max_tokens: 12 };

function checkCall(call) {
  assert.equal(call.type, "function");
  assert.match(call.id, /^call_[0-9a-f]{24}$/);
  assert.equal(call.function.name, "get_weather");
  assert.deepEqual(JSON.parse(call.function.arguments), ARGS);
}

let plainCall = null, finalAnswer = null;
test("openai: tools -> tool_calls -> tool result -> answer", async () => {
  const messages = [...examples(), { role: "user", content: QUESTION }];
  const r1 = await openai.chat.completions.create({ ...forced, messages });
  const m1 = r1.choices[0].message;
  assert.equal(r1.choices[0].finish_reason, "tool_calls", JSON.stringify(m1));
  assert.equal(m1.content, null);
  assert.equal(m1.tool_calls.length, 1);
  checkCall(m1.tool_calls[0]);
  plainCall = m1.tool_calls[0];
  messages.push(m1, { role: "tool", tool_call_id: m1.tool_calls[0].id, content: RESULT });
  const r2 = await openai.chat.completions.create({ ...answer, messages });
  assert.ok(["stop", "length"].includes(r2.choices[0].finish_reason), JSON.stringify(r2.choices[0]));
  assert.ok(typeof r2.choices[0].message.content === "string" && r2.choices[0].message.content.length > 0);
  assert.equal(r2.choices[0].message.tool_calls, undefined);
  finalAnswer = r2.choices[0].message.content;
  // The tool result went into the prompt (and the first turn was reused).
  assert.ok(r2.usage.prompt_tokens > r1.usage.prompt_tokens + r1.usage.completion_tokens);
  assert.ok(r2.usage.prompt_tokens_details.cached_tokens > 0);
});

test("openai stream: tool call deltas, finish_reason tool_calls, then the answer", async () => {
  const messages = [...examples(), { role: "user", content: QUESTION }];
  const stream = await openai.chat.completions.create({ ...forced, messages, stream: true,
                                                        stream_options: { include_usage: true } });
  const calls = [];
  let finish = null, content = "", usage = null, firstDeltas = 0;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    const c = chunk.choices[0];
    if (!c) continue;
    if (c.finish_reason) finish = c.finish_reason;
    if (c.delta.content) content += c.delta.content;
    for (const d of c.delta.tool_calls ?? []) {
      if (d.id) {  // the first delta of a call: id, type and name, no arguments yet
        firstDeltas++;
        assert.equal(d.type, "function");
        assert.equal(d.function.arguments, "");
        calls[d.index] = { id: d.id, type: d.type, function: { name: d.function.name, arguments: "" } };
      } else {
        calls[d.index].function.arguments += d.function.arguments;
      }
    }
  }
  assert.equal(finish, "tool_calls");
  assert.equal(content, "");
  assert.equal(firstDeltas, 1);
  checkCall(calls[0]);
  assert.equal(calls[0].function.arguments, plainCall.function.arguments);
  assert.ok(usage.completion_tokens > 0);
  messages.push({ role: "assistant", content: null, tool_calls: calls },
                { role: "tool", tool_call_id: calls[0].id, content: RESULT });
  let text = "";
  for await (const chunk of await openai.chat.completions.create({ ...answer, messages, stream: true })) {
    text += chunk.choices[0]?.delta?.content ?? "";
    if (chunk.choices[0]?.finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.equal(text, finalAnswer);  // the same conversation, so the same greedy answer
  assert.ok(finish === "stop" || finish === "length");
});

test("openai: tool_choice none leaves the tools out; unsupported fields are 400s naming them", async () => {
  await assert.rejects(
    openai.chat.completions.create({ ...common, messages: [{ role: "user", content: "x" }], reasoning_effort: "low" }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "reasoning_effort");
  await assert.rejects(
    openai.chat.completions.create({ ...common, messages: [{ role: "user", content: "x" }], n: 2 }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "n");
  const r = await openai.chat.completions.create({ ...common, tool_choice: "none", max_tokens: 4,
                                                   messages: [{ role: "user", content: QUESTION }] });
  assert.equal(r.choices[0].message.tool_calls, undefined);
});

// Anthropic's shapes for the same conversation.
function anthropicExamples() {
  const m = [];
  for (let k = 0; k < 2; k++) {
    const id = `toolu_example${k}`;
    m.push({ role: "user", content: QUESTION });
    m.push({ role: "assistant", content: [{ type: "tool_use", id, name: "get_weather", input: ARGS }] });
    m.push({ role: "user", content: [{ type: "tool_result", tool_use_id: id, content: RESULT }] });
    m.push({ role: "assistant", content: ANSWER });
  }
  return m;
}
const anthropicTools = [{ name: "get_weather", description: "Current weather in a city",
                          input_schema: weatherTool.function.parameters }];
const anthropicCommon = { model: "coder-mini", tools: anthropicTools, temperature: 0 };
const anthropicForced = { ...anthropicCommon, tool_choice: { type: "any" }, max_tokens: 21 };
const anthropicAnswer = { ...anthropicCommon, max_tokens: 12 };

test("anthropic: tool_use -> tool_result -> answer", async () => {
  const messages = [...anthropicExamples(), { role: "user", content: QUESTION }];
  const r1 = await anthropic.messages.create({ ...anthropicForced, messages });
  assert.equal(r1.type, "message");
  assert.match(r1.id, /^msg_/);
  assert.equal(r1.stop_reason, "tool_use", JSON.stringify(r1.content));
  const use = r1.content.find((b) => b.type === "tool_use");
  assert.equal(use.name, "get_weather");
  assert.deepEqual(use.input, ARGS);
  assert.match(use.id, /^toolu_/);
  assert.ok(r1.usage.input_tokens > 0 && r1.usage.output_tokens > 0);
  // count_tokens builds the same prompt without generating.
  const count = await anthropic.messages.countTokens({ model: "coder-mini", messages, tools: anthropicTools,
                                                        tool_choice: { type: "any" } });
  assert.equal(count.input_tokens, r1.usage.input_tokens);
  messages.push({ role: "assistant", content: r1.content },
                { role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: RESULT }] });
  const r2 = await anthropic.messages.create({ ...anthropicAnswer, messages });
  assert.ok(["end_turn", "max_tokens"].includes(r2.stop_reason));
  assert.equal(r2.content.length, 1);
  assert.equal(r2.content[0].type, "text");
  // The Anthropic conversation renders to the same prompt as the OpenAI one.
  assert.equal(r2.content[0].text, finalAnswer);
});

test("anthropic stream: the SDK assembles tool_use from input_json_delta", async () => {
  const messages = [...anthropicExamples(), { role: "user", content: QUESTION }];
  const events = [];
  const stream = anthropic.messages.stream({ ...anthropicForced, messages });
  stream.on("streamEvent", (e) => events.push(e.type));
  const msg = await stream.finalMessage();
  assert.equal(msg.stop_reason, "tool_use");
  const use = msg.content.find((b) => b.type === "tool_use");
  assert.deepEqual(use.input, ARGS);
  assert.equal(events[0], "message_start");
  assert.deepEqual(events.slice(-2), ["message_delta", "message_stop"]);
  assert.ok(events.includes("content_block_start") && events.includes("content_block_stop"));
  messages.push({ role: "assistant", content: msg.content },
                { role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: RESULT }] });
  let text = "";
  const s2 = anthropic.messages.stream({ ...anthropicAnswer, messages });
  s2.on("text", (t) => { text += t; });
  const final = await s2.finalMessage();
  assert.equal(text, finalAnswer);
  assert.ok(["end_turn", "max_tokens"].includes(final.stop_reason));
});

test("anthropic: errors are the SDK's classes", async () => {
  await assert.rejects(
    anthropic.messages.create({ model: "coder-mini", messages: [{ role: "user", content: "x" }], max_tokens: 4,
                                thinking: { type: "enabled", budget_tokens: 1024 } }),
    (e) => e instanceof Anthropic.BadRequestError && e.error?.error?.type === "invalid_request_error" &&
           /thinking/.test(e.message));
  const bad = new Anthropic({ baseURL: `http://127.0.0.1:${port}`, apiKey: "wrong", maxRetries: 0 });
  await assert.rejects(bad.messages.create({ model: "coder-mini", messages: [{ role: "user", content: "x" }], max_tokens: 4 }),
                       (e) => e instanceof Anthropic.AuthenticationError && e.status === 401);
  await assert.rejects(
    anthropic.messages.create({ model: "claude-x", messages: [{ role: "user", content: "x" }], max_tokens: 4 }),
    (e) => e instanceof Anthropic.NotFoundError);
});

await runTests(tests, proc);
