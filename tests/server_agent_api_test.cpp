// The agent-facing request and response shapes, without HTTP: OpenAI chat
// fields (tools, tool_choice, tool messages, logprobs, sampling), the
// allow-lists, the Anthropic Messages conversion and its event stream, the
// chat prompt's tool handling, and log-probabilities against a hand-computed
// log-softmax.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "engine/logprobs.h"
#include "engine/sampler.h"
#include "server/anthropic_api.h"
#include "server/chat_prompt.h"
#include "server/openai_api.h"

namespace server_agent_api_test {

using namespace flashmoe;
using namespace flashmoe::server;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kSrc = FLASHMOE_SOURCE_DIR;

// The ApiError's param and message for a body, or "ok".
std::string error_of(const std::string& body, bool chat = true) {
  try {
    parse_completion_request(body, chat);
    return "ok";
  } catch (const ApiError& e) {
    return std::to_string(e.status) + " " + e.param + ": " + e.what();
  }
}

std::string anthropic_error_of(const std::string& body) {
  try {
    parse_anthropic_request(body);
    return "ok";
  } catch (const ApiError& e) {
    return std::to_string(e.status) + " " + e.param + ": " + e.what();
  }
}

std::string chat_body(const std::string& extra) {
  return R"({"messages":[{"role":"user","content":"x"}])" + (extra.empty() ? "" : "," + extra) + "}";
}

const char* kTool = R"({"type":"function","function":{"name":"get_weather","description":"d",
  "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}})";

}  // namespace

TEST(ServerAgentApi, UnsupportedFieldsAreNamed) {
  // response_format is parsed here and compiled by the server (tests/server_json_test.cpp).
  EXPECT_EQ(error_of(chat_body(R"("response_format":{"type":"json_object"})")), "ok");
  EXPECT_EQ(error_of(chat_body(R"("reasoning_effort":"low")")),
            "400 reasoning_effort: 'reasoning_effort' is not supported by this server");
  EXPECT_EQ(error_of(chat_body(R"("functions":[])")).substr(0, 14), "400 functions:");
  EXPECT_EQ(error_of(chat_body(R"("stream_options":{"include_obfuscation":true})")).substr(0, 40),
            "400 stream_options.include_obfuscation: ");
  EXPECT_EQ(error_of(R"({"messages":[{"role":"user","content":"x","name":"bob"}]})").substr(0, 21), "400 messages[0].name:");
  EXPECT_EQ(error_of(R"({"prompt":"x","suffix":"y"})", false).substr(0, 11), "400 suffix:");
  EXPECT_EQ(error_of(R"({"prompt":"x","echo":true})", false).substr(0, 9), "400 echo:");
  EXPECT_EQ(error_of(chat_body(R"("n":3)")), "400 n: only n = 1 is supported");
  EXPECT_EQ(error_of(chat_body(R"("parallel_tool_calls":false,"tools":[)" + std::string(kTool) + "]")).substr(0, 24),
            "400 parallel_tool_calls:");
  // null is the same as absent, for known and unknown fields alike.
  EXPECT_EQ(error_of(chat_body(R"("response_format":null,"whatever":null,"logprobs":null)")), "ok");
  EXPECT_EQ(error_of(chat_body(R"("user":"u1","ignore_eos":false)")), "ok");
}

TEST(ServerAgentApi, SamplingFields) {
  auto r = parse_completion_request(
      chat_body(R"("top_k":40,"min_p":0.05,"repetition_penalty":1.1,"logit_bias":{"17":-100,"3":2.5},
                   "logprobs":true,"top_logprobs":5,"max_completion_tokens":9)"),
      true);
  EXPECT_EQ(*r.top_k, 40);
  EXPECT_FLOAT_EQ(*r.min_p, 0.05f);
  EXPECT_FLOAT_EQ(*r.repetition_penalty, 1.1f);
  ASSERT_EQ(r.logit_bias.size(), 2u);
  EXPECT_EQ(r.logit_bias[0], std::make_pair(int32_t(17), -100.0f));
  EXPECT_EQ(r.top_logprobs, 5);
  EXPECT_EQ(*r.max_tokens, 9);
  EXPECT_EQ(parse_completion_request(chat_body(R"("logprobs":true)"), true).top_logprobs, 0);
  EXPECT_EQ(parse_completion_request(chat_body(""), true).top_logprobs, -1);
  EXPECT_EQ(parse_completion_request(R"({"prompt":"x","logprobs":3})", false).top_logprobs, 3);
  EXPECT_EQ(error_of(chat_body(R"("top_logprobs":3)")), "400 top_logprobs: 'top_logprobs' requires 'logprobs': true");
  EXPECT_EQ(error_of(chat_body(R"("logprobs":true,"top_logprobs":21)")).substr(0, 17), "400 top_logprobs:");
  EXPECT_EQ(error_of(chat_body(R"("logit_bias":{"x":1})")).substr(0, 15), "400 logit_bias:");
  EXPECT_EQ(error_of(chat_body(R"("logit_bias":{"1":101})")).substr(0, 15), "400 logit_bias:");
  EXPECT_EQ(error_of(chat_body(R"("min_p":2)")).substr(0, 10), "400 min_p:");
  EXPECT_EQ(error_of(chat_body(R"("top_k":-2)")).substr(0, 10), "400 top_k:");
  EXPECT_EQ(error_of(chat_body(R"("max_completion_tokens":0)")).substr(0, 26), "400 max_completion_tokens:");
}

TEST(ServerAgentApi, ToolsToolChoiceAndToolMessages) {
  auto r = parse_completion_request(
      R"({"messages":[{"role":"user","content":"weather?"},
          {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",
            "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
          {"role":"tool","tool_call_id":"call_1","content":[{"type":"text","text":"sunny"}]}],
          "tools":[)" + std::string(kTool) + R"(],"tool_choice":{"type":"function","function":{"name":"get_weather"}},
          "chat_template_kwargs":{"enable_thinking":false}})",
      true);
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1]["content"], "");
  EXPECT_EQ(r.messages[1]["tool_calls"][0]["function"]["arguments"], ojson::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(r.messages[2], ojson::parse(R"({"role":"tool","content":"sunny","tool_call_id":"call_1"})"));
  EXPECT_EQ(r.tool_choice, ToolChoice::Named);
  EXPECT_EQ(r.tool_name, "get_weather");
  EXPECT_EQ(r.template_kwargs["enable_thinking"], false);

  const std::string tools = R"("tools":[)" + std::string(kTool) + "]";
  EXPECT_EQ(error_of(chat_body(R"("tool_choice":"required")")).substr(0, 16), "400 tool_choice:");
  EXPECT_EQ(error_of(chat_body(tools + R"(,"tool_choice":{"type":"function","function":{"name":"nope"}})")),
            "400 tool_choice: 'tool_choice' names the tool 'nope', which is not in 'tools'");
  EXPECT_EQ(error_of(chat_body(tools + R"(,"tool_choice":"sometimes")")).substr(0, 16), "400 tool_choice:");
  EXPECT_EQ(error_of(chat_body(R"("tools":[{"type":"retrieval"}])")).substr(0, 14), "400 tools[0]: ");
  EXPECT_EQ(error_of(chat_body(R"("tools":[)" + std::string(kTool) + "," + kTool + "]")),
            "400 tools[1].function.name: two tools are named 'get_weather'");
  EXPECT_EQ(error_of(chat_body(R"("tools":[{"type":"function","function":{"name":"f","strict":true}}])")).substr(0, 30),
            "400 tools[0].function.strict: ");
  EXPECT_EQ(error_of(R"({"messages":[{"role":"tool","content":"x"}]})"),
            "400 messages[0].tool_call_id: 'messages[0].tool_call_id' is required for a tool message");
  EXPECT_EQ(error_of(R"({"messages":[{"role":"assistant","tool_calls":[{"type":"function","function":{"name":"f","arguments":"[1]"}}]}]})")
                .substr(0, 50),
            "400 messages[0].tool_calls[0].function.arguments: ");
  EXPECT_EQ(error_of(chat_body(R"("chat_template_kwargs":{"messages":[]})")).substr(0, 34),
            "400 chat_template_kwargs.messages:");
}

// The prompt: tools reach the template (not with tool_choice none), a
// template without tool support refuses them, and required / named choices
// start the call in the prompt in the template's own syntax.
TEST(ServerAgentApi, ChatPromptToolsAndForcedCalls) {
  const ChatTemplate qwen3 = ChatTemplate::load(kSrc + "/tests/fixtures/tokenizers/qwen3/tokenizer_config.json");
  const ChatTemplate chatml = ChatTemplate::load(kSrc + "/models/coder-mini");
  CompletionRequest q = parse_completion_request(chat_body(R"("tools":[)" + std::string(kTool) + "]"), true);
  ChatPrompt p = build_chat_prompt(qwen3, q);
  EXPECT_NE(p.text.find("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""), std::string::npos);
  EXPECT_TRUE(p.tools);
  EXPECT_EQ(p.prefill, "");
  EXPECT_EQ(p.syntax, ToolSyntax::Json);
  try {
    build_chat_prompt(chatml, q);
    ADD_FAILURE() << "tools accepted by a template without tool support";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "tools");
  }
  q.tool_choice = ToolChoice::None;
  p = build_chat_prompt(qwen3, q);
  EXPECT_EQ(p.text.find("<tools>"), std::string::npos);
  EXPECT_FALSE(p.tools);
  q.tool_choice = ToolChoice::Named;
  q.tool_name = "get_weather";
  p = build_chat_prompt(qwen3, q);
  EXPECT_EQ(p.prefill, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ");
  EXPECT_TRUE(p.text.ends_with("<|im_start|>assistant\n" + p.prefill));
  q.tool_choice = ToolChoice::Required;
  EXPECT_EQ(build_chat_prompt(qwen3, q).prefill, "<tool_call>\n{\"name\": \"");
  // chat_template_kwargs reach the template.
  q.tool_choice = ToolChoice::Auto;
  q.template_kwargs = {{"enable_thinking", false}};
  EXPECT_TRUE(build_chat_prompt(qwen3, q).text.ends_with("<think>\n\n</think>\n\n"));
  // An XML-syntax template that opens <think> in its generation prompt: the
  // forced call closes the reasoning first.
  std::ifstream xs(kSrc + "/tests/fixtures/tools/xml_tools.jinja");
  const ChatTemplate xml(std::string((std::istreambuf_iterator<char>(xs)), std::istreambuf_iterator<char>()));
  q.template_kwargs = ojson::object();
  q.tool_choice = ToolChoice::Named;
  p = build_chat_prompt(xml, q);
  EXPECT_TRUE(p.in_reasoning);  // the output parser reads the prefill's </think> first
  EXPECT_EQ(p.syntax, ToolSyntax::Xml);
  EXPECT_EQ(p.prefill, "\n</think>\n\n<tool_call>\n<function=get_weather>\n");
  q.tool_choice = ToolChoice::Auto;
  EXPECT_TRUE(build_chat_prompt(xml, q).in_reasoning);
}

TEST(ServerAgentApi, AnthropicRequestBecomesChatMessages) {
  CompletionRequest r = parse_anthropic_request(R"({
    "model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": [{"type": "thinking", "thinking": "need a tool", "signature": ""},
                                        {"type": "text", "text": "Checking."},
                                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                   {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}],
    "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "any"}, "stop_sequences": ["END"], "temperature": 0.2, "top_k": 5, "stream": true,
    "metadata": {"user_id": "u"}})");
  const ojson want = ojson::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "need a tool",
     "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
    {"role": "user", "content": "And tomorrow?"}])");
  EXPECT_EQ(r.messages, want);
  EXPECT_EQ(r.tools, ojson::parse(R"([{"type": "function", "function": {"name": "get_weather", "description": "d",
                                       "parameters": {"type": "object"}}}])"));
  EXPECT_EQ(r.tool_choice, ToolChoice::Required);
  EXPECT_EQ(*r.max_tokens, 100);
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(*r.top_k, 5);
  EXPECT_TRUE(r.stream);

  const std::string base = R"("model":"m","messages":[{"role":"user","content":"x"}])";
  EXPECT_EQ(anthropic_error_of("{" + base + "}"), "400 max_tokens: 'max_tokens' is required");
  EXPECT_EQ(anthropic_error_of("{" + base + R"(,"max_tokens":5,"thinking":{"type":"enabled"}})"),
            "400 thinking: 'thinking' is not supported by this server");
  EXPECT_EQ(anthropic_error_of("{" + base + R"(,"max_tokens":5,"temperature":1.5})").substr(0, 16), "400 temperature:");
  EXPECT_EQ(anthropic_error_of(R"({"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]})")
                .substr(0, 29),
            "400 messages[0].content[0].ty");
  EXPECT_EQ(anthropic_error_of("{" + base + R"(,"max_tokens":5,"tool_choice":{"type":"tool","name":"f"}})").substr(0, 16),
            "400 tool_choice:");
  EXPECT_EQ(anthropic_error_of("{" + base + R"(,"max_tokens":5,"tools":[{"type":"bash_20250124","name":"bash"}]})").substr(0, 18),
            "400 tools[0].type:");
  // count_tokens bodies: no max_tokens needed, generation fields refused.
  EXPECT_EQ(parse_anthropic_request("{" + base + "}", /*count_tokens=*/true).messages.size(), 1u);
  try {
    parse_anthropic_request("{" + base + R"(,"max_tokens":5})", true);
    ADD_FAILURE() << "max_tokens accepted by count_tokens";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "max_tokens");
  }
  EXPECT_EQ(anthropic_error_body(401, "no"), R"({"type":"error","error":{"type":"authentication_error","message":"no"}})");
  EXPECT_EQ(anthropic_stop_reason("stop", "", true), "tool_use");
  EXPECT_EQ(anthropic_stop_reason("stop", "END", false), "stop_sequence");
  EXPECT_EQ(anthropic_stop_reason("length", "", true), "tool_use");
  EXPECT_EQ(anthropic_stop_reason("length", "", false), "max_tokens");
  EXPECT_EQ(anthropic_stop_reason("stop", "", false), "end_turn");
}

// The event sequence Anthropic documents: message_start, then per block
// content_block_start / _delta... / _stop (tool input as input_json_delta),
// message_delta with stop_reason and usage, message_stop; and the same
// blocks in the non-streamed Message.
TEST(ServerAgentApi, AnthropicEventStream) {
  AnthropicMessageBuilder b("msg_1", "m", 12);
  std::string s = b.start_event();
  s += b.add({{OutputEvent::Kind::Reasoning, "hmm", {}}, {OutputEvent::Kind::Content, "Let me ", {}}});
  s += b.add({{OutputEvent::Kind::Content, "check.", {}}, {OutputEvent::Kind::ToolCall, "", {"get_weather", R"({"city":"Paris"})"}}});
  s += b.finish_events("tool_use", "", 7);
  std::vector<std::string> names;
  std::vector<ojson> data;
  for (size_t at = 0; (at = s.find("event: ", at)) != std::string::npos;) {
    size_t nl = s.find('\n', at);
    names.push_back(s.substr(at + 7, nl - at - 7));
    size_t end = s.find("\n\n", nl);
    data.push_back(ojson::parse(s.substr(nl + 7, end - nl - 7)));
    at = end;
  }
  const std::vector<std::string> want = {"message_start", "content_block_start", "content_block_delta",
                                         "content_block_stop", "content_block_start", "content_block_delta",
                                         "content_block_delta", "content_block_stop", "content_block_start",
                                         "content_block_delta", "content_block_stop", "message_delta", "message_stop"};
  EXPECT_EQ(names, want);
  for (size_t k = 0; k < names.size(); ++k) EXPECT_EQ(data[k]["type"], names[k]);
  EXPECT_EQ(data[0]["message"]["usage"]["input_tokens"], 12);
  EXPECT_EQ(data[1]["content_block"]["type"], "thinking");
  EXPECT_EQ(data[2]["delta"], ojson::parse(R"({"type":"thinking_delta","thinking":"hmm"})"));
  EXPECT_EQ(data[6]["delta"], ojson::parse(R"({"type":"text_delta","text":"check."})"));
  EXPECT_EQ(data[8]["index"], 2);
  EXPECT_EQ(data[8]["content_block"]["type"], "tool_use");
  EXPECT_EQ(data[8]["content_block"]["name"], "get_weather");
  EXPECT_EQ(data[8]["content_block"]["input"], ojson::object());
  EXPECT_EQ(data[9]["delta"], ojson::parse(R"({"type":"input_json_delta","partial_json":"{\"city\":\"Paris\"}"})"));
  EXPECT_EQ(data[11]["delta"]["stop_reason"], "tool_use");
  EXPECT_EQ(data[11]["usage"]["output_tokens"], 7);
  const ojson m = b.message("tool_use", "", 7);
  ASSERT_EQ(m["content"].size(), 3u);
  EXPECT_EQ(m["content"][1], ojson::parse(R"({"type":"text","text":"Let me check."})"));
  EXPECT_EQ(m["content"][2]["input"], ojson::parse(R"({"city":"Paris"})"));
  EXPECT_EQ(m["content"][2]["id"], data[8]["content_block"]["id"]);
}

// log_softmax by hand: logits {0, ln 2, ln 5} -> probabilities 1/8, 2/8, 5/8.
TEST(ServerAgentApi, TokenLogprobIsLogSoftmaxOfTheLogits) {
  const std::vector<float> l = {0.0f, std::log(2.0f), std::log(5.0f), std::log(0.5f) + 100.0f - 100.0f};
  // The 4th: probability 0.5/8.5; the others /8.5 too.
  TokenLogprob lp = token_logprob(l, 1, 2);
  EXPECT_NEAR(lp.logprob, std::log(2.0 / 8.5), 1e-6);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].first, 2);
  EXPECT_NEAR(lp.top[0].second, std::log(5.0 / 8.5), 1e-6);
  EXPECT_EQ(lp.top[1].first, 1);
  // Shifting every logit changes nothing; large values do not overflow.
  std::vector<float> big = l;
  for (float& x : big) x += 1000.0f;
  EXPECT_NEAR(token_logprob(big, 1, 0).logprob, std::log(2.0 / 8.5), 1e-4);
  EXPECT_TRUE(token_logprob(big, 1, 0).top.empty());
}

TEST(ServerAgentApi, LogitBiasSteersTheSampler) {
  SamplingParams p;
  p.temperature = 0;
  const std::vector<float> l = {3.0f, 1.0f, 2.0f};
  EXPECT_EQ(Sampler(p).sample(l), 0);
  p.logit_bias = {{0, -100.0f}};
  EXPECT_EQ(Sampler(p).sample(l), 2);
  p.logit_bias = {{1, 100.0f}};
  EXPECT_EQ(Sampler(p).sample(l), 1);
}

}  // namespace server_agent_api_test
