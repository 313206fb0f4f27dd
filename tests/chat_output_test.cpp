// The chat output parser (reasoning / answer / tool calls) and the tool-call
// round trip through chat templates: conversations with tools, tool calls and
// tool results rendered byte-identically to Jinja2 (the reference renders in
// tests/fixtures/tools/renders.jsonl, made by make_renders.py the way
// transformers renders), and every tool call a template writes parsed back
// into the call it came from.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "server/chat_output.h"
#include "tokenizer/chat_template.h"

namespace chat_output_test {

using namespace flashmoe;
using namespace flashmoe::server;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kSrc = FLASHMOE_SOURCE_DIR;

const ojson kTools = ojson::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
                   "opts": {"type": "object"}, "maybe": {"type": ["integer", "null"]}}}}}])");

// Everything the parser gives for `text` fed in pieces of `step` bytes,
// merged: consecutive events of one kind joined.
std::vector<OutputEvent> parse(const std::string& text, size_t step, bool tools = true, bool in_reasoning = false) {
  ChatOutputParser p({in_reasoning, tools, kTools});
  std::vector<OutputEvent> all;
  auto take = [&](std::vector<OutputEvent> ev) {
    for (auto& e : ev) {
      if (!all.empty() && all.back().kind == e.kind && e.kind != OutputEvent::Kind::ToolCall) all.back().text += e.text;
      else all.push_back(std::move(e));
    }
  };
  for (size_t i = 0; i < text.size(); i += step) take(p.feed(text.substr(i, step)));
  take(p.finish());
  return all;
}

std::string describe(const std::vector<OutputEvent>& ev) {
  std::string s;
  for (const auto& e : ev) {
    if (e.kind == OutputEvent::Kind::Reasoning) s += "R[" + e.text + "]";
    else if (e.kind == OutputEvent::Kind::Content) s += "C[" + e.text + "]";
    else s += "T[" + e.call.name + " " + e.call.arguments + "]";
  }
  return s;
}

// The same events whatever the piece size (1 byte at a time up to all at once).
std::string parsed(const std::string& text, bool tools = true, bool in_reasoning = false) {
  const std::string whole = describe(parse(text, text.size() + 1, tools, in_reasoning));
  for (size_t step : {1, 2, 3, 5, 7, 13})
    EXPECT_EQ(describe(parse(text, step, tools, in_reasoning)), whole) << "piece size " << step;
  return whole;
}

}  // namespace

TEST(ChatOutput, PlainTextPassesThrough) {
  EXPECT_EQ(parsed("def f(x):\n    return x < 3\n"), "C[def f(x):\n    return x < 3\n]");
  EXPECT_EQ(parsed("a <tool b <think> c"), "C[a <tool b <think> c]");
  EXPECT_EQ(parsed("<tool_call>\n{\"name\": \"f\"}\n</tool_call>", /*tools=*/false),
            "C[<tool_call>\n{\"name\": \"f\"}\n</tool_call>]");
}

TEST(ChatOutput, ReasoningSplitFromAnswer) {
  EXPECT_EQ(parsed("<think>\nstep 1\nstep 2\n</think>\n\nThe answer."), "R[step 1\nstep 2]C[The answer.]");
  // Qwen3.5: the generation prompt already opened <think>.
  EXPECT_EQ(parsed("step 1\n</think>\n\nDone.", true, /*in_reasoning=*/true), "R[step 1]C[Done.]");
  EXPECT_EQ(parsed("\n\n</think>\n\nDone.", true, true), "C[Done.]");
  // Cut off while thinking (max_tokens): what there is, as reasoning.
  EXPECT_EQ(parsed("<think>\nstill going", true), "R[still going]");
  // <think> only counts at the start.
  EXPECT_EQ(parsed("x <think>y</think>"), "C[x <think>y</think>]");
}

TEST(ChatOutput, Qwen3JsonToolCalls) {
  EXPECT_EQ(parsed("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>"),
            "T[get_weather {\"city\":\"Paris\",\"days\":3}]");
  // Text before, two calls, whitespace between them dropped.
  EXPECT_EQ(parsed("Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
                   "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"q\": \"x y\"}}\n</tool_call>"),
            "C[Let me check.]T[a {}]T[b {\"q\":\"x y\"}]");
  // With reasoning first.
  EXPECT_EQ(parsed("<think>\nneed weather\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"k\": [1, 2]}}\n</tool_call>"),
            "R[need weather]T[f {\"k\":[1,2]}]");
  // Arguments given as a JSON string, and missing arguments.
  EXPECT_EQ(parsed("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>"), "T[f {\"a\":1}]");
  EXPECT_EQ(parsed("<tool_call>{\"name\": \"f\"}</tool_call>"), "T[f {}]");
  // The end-of-turn token came before </tool_call>: a complete call still counts.
  EXPECT_EQ(parsed("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n"), "T[f {\"a\":1}]");
}

// A model that forgets </tool_call>: the call ends with its JSON object and
// what follows is answer text again (braces inside strings do not count).
TEST(ChatOutput, JsonCallWithoutClosingTagEndsWithItsObject) {
  EXPECT_EQ(parsed("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"}\"}}\nprint(1)"),
            "T[f {\"a\":\"}\"}]C[\nprint(1)]");
  EXPECT_EQ(parsed("<tool_call>{\"name\": \"f\", \"arguments\": {}} </x>"), "T[f {}]C[ </x>]");
  EXPECT_EQ(parsed("<tool_call>{\"name\": \"f\", \"arguments\": {}}<tool_call>{\"name\": \"g\"}</tool_call>"),
            "T[f {}]T[g {}]");
  // Not a call object: stays text as a whole.
  EXPECT_EQ(parsed("<tool_call>{\"x\": 1} and more"), "C[<tool_call>{\"x\": 1} and more]");
}

TEST(ChatOutput, MalformedCallsStayText) {
  EXPECT_EQ(parsed("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": </tool_call> ok"),
            "C[<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": </tool_call> ok]");
  EXPECT_EQ(parsed("<tool_call>\n{\"arguments\": {}}\n</tool_call>"), "C[<tool_call>\n{\"arguments\": {}}\n</tool_call>]");
  EXPECT_EQ(parsed("<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>"),
            "C[<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>]");
  EXPECT_EQ(parsed("x <tool_call>\n{\"name\": \"f\", \"argu"), "C[x <tool_call>\n{\"name\": \"f\", \"argu]");
  EXPECT_EQ(parsed("<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"),
            "C[<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>]");
}

TEST(ChatOutput, Qwen35XmlToolCallsTypedBySchema) {
  EXPECT_EQ(parsed("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n02139\n</parameter>\n"
                   "<parameter=opts>\n{\"units\": \"C\"}\n</parameter>\n<parameter=maybe>\n7\n</parameter>\n"
                   "</function>\n</tool_call>"),
            "T[get_weather {\"city\":\"New York\",\"days\":3,\"zip\":\"02139\",\"opts\":{\"units\":\"C\"},\"maybe\":7}]");
  // Multi-line values keep their inner newlines; a non-numeric "integer"
  // stays the string the model wrote; unknown parameters are strings.
  EXPECT_EQ(parsed("<tool_call>\n<function=get_weather>\n<parameter=city>\nline 1\nline 2\n</parameter>\n"
                   "<parameter=days>\nthree\n</parameter>\n<parameter=other>\n5\n</parameter>\n</function>\n</tool_call>"),
            "T[get_weather {\"city\":\"line 1\\nline 2\",\"days\":\"three\",\"other\":\"5\"}]");
  EXPECT_EQ(parsed("<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"), "R[hmm]T[f {}]");
}

// Whitespace-only answers are kept when there is no call.
TEST(ChatOutput, WhitespaceOnlyAnswerKeptWithoutCalls) {
  EXPECT_EQ(parsed("\n\n"), "C[\n\n]");
  EXPECT_EQ(parsed("\n\nok\n"), "C[\n\nok\n]");
}

// The fixture conversations render as Jinja2 renders them, for Qwen3's
// template and an XML-syntax one; and each tool call a template wrote parses
// back to the call in the message (name and arguments as JSON values).
TEST(ChatOutput, TemplatesRenderToolTurnsAndCallsParseBack) {
  const ChatTemplate qwen3 = ChatTemplate::load(kSrc + "/tests/fixtures/tokenizers/qwen3/tokenizer_config.json");
  std::ifstream xs(kSrc + "/tests/fixtures/tools/xml_tools.jinja");
  const ChatTemplate xml(std::string((std::istreambuf_iterator<char>(xs)), std::istreambuf_iterator<char>()));
  std::ifstream in(kSrc + "/tests/fixtures/tools/renders.jsonl");
  ASSERT_TRUE(in);
  std::string line;
  int rows = 0, calls_checked = 0;
  while (std::getline(in, line)) {
    const ojson row = ojson::parse(line);
    const ChatTemplate& t = row["template"] == "qwen3" ? qwen3 : xml;
    std::optional<bool> thinking;
    if (row["enable_thinking"].is_boolean()) thinking = row["enable_thinking"].get<bool>();
    const std::string got = t.render(row["messages"], true, thinking, row["tools"]);
    EXPECT_EQ(got, row["rendered"].get<std::string>()) << "row " << rows + 1;
    ++rows;
    // Each assistant turn with calls: its rendered text parses back to them.
    size_t from = 0;
    for (const auto& msg : row["messages"]) {
      if (msg["role"] != "assistant") continue;
      const size_t start = got.find("<|im_start|>assistant\n", from);
      ASSERT_NE(start, std::string::npos);
      const size_t body = start + std::string("<|im_start|>assistant\n").size();
      const size_t end = got.find("<|im_end|>", body);
      from = end;
      if (!msg.contains("tool_calls")) continue;
      ChatOutputParser p({false, true, row["tools"]});
      std::vector<OutputEvent> ev = p.feed(got.substr(body, end - body));
      for (auto& e : p.finish()) ev.push_back(e);
      std::vector<ToolCall> calls;
      std::string content;
      for (const auto& e : ev) {
        if (e.kind == OutputEvent::Kind::ToolCall) calls.push_back(e.call);
        if (e.kind == OutputEvent::Kind::Content) content += e.text;
      }
      ASSERT_EQ(calls.size(), msg["tool_calls"].size()) << got;
      for (size_t k = 0; k < calls.size(); ++k) {
        EXPECT_EQ(calls[k].name, msg["tool_calls"][k]["function"]["name"].get<std::string>());
        EXPECT_EQ(nlohmann::json::parse(calls[k].arguments),
                  nlohmann::json::parse(msg["tool_calls"][k]["function"]["arguments"].dump()));
        ++calls_checked;
      }
      EXPECT_EQ(content, msg["content"].get<std::string>());
    }
  }
  EXPECT_EQ(rows, 16);
  EXPECT_EQ(calls_checked, 12);
}

}  // namespace chat_output_test
