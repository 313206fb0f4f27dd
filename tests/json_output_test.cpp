// Structured output end to end on models/coder-mini (a model that has only
// seen Python): for 20 schemas covering every supported keyword, generation
// under the constraint, greedy and seeded, must end on its own (EOS or the
// value's end, never the token limit) with text that parses and validates.
// The validator below is written from the JSON Schema specification, apart
// from the grammar compiler, so the two must agree for the test to pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <regex>

#include "engine/generator.h"
#include "engine/json_schema_grammar.h"
#include "engine/token_constraint.h"
#include "test_util.h"

namespace json_output_test {

using namespace flashmoe;
using namespace flashmoe::test;
using json = nlohmann::ordered_json;

namespace {

// ---- a small JSON Schema validator (the keywords the compiler supports) ----

size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool has_type(const json& v, const std::string& t) {
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "string") return v.is_string();
  if (t == "number") return v.is_number();
  if (t == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()));
  if (t == "boolean") return v.is_boolean();
  if (t == "null") return v.is_null();
  return false;
}

bool valid(const json& v, const json& s, const json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) return valid(v, root.at(json::json_pointer(s["$ref"].get<std::string>().substr(1))), root);
  if (s.contains("allOf"))
    for (const auto& sub : s["allOf"])
      if (!valid(v, sub, root)) return false;
  if (s.contains("anyOf") &&
      std::none_of(s["anyOf"].begin(), s["anyOf"].end(), [&](const json& sub) { return valid(v, sub, root); }))
    return false;
  if (s.contains("oneOf") &&
      std::count_if(s["oneOf"].begin(), s["oneOf"].end(), [&](const json& sub) { return valid(v, sub, root); }) != 1)
    return false;
  if (s.contains("const") && v != s["const"]) return false;
  if (s.contains("enum") && std::find(s["enum"].begin(), s["enum"].end(), v) == s["enum"].end()) return false;
  if (s.contains("type")) {
    const json& t = s["type"];
    bool ok = false;
    if (t.is_string()) ok = has_type(v, t.get<std::string>());
    else
      for (const auto& x : t) ok = ok || has_type(v, x.get<std::string>());
    if (!ok) return false;
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    for (const auto& r : s.value("required", json::array()))
      if (!v.contains(r.get<std::string>())) return false;
    for (const auto& [k, x] : v.items()) {
      if (props.contains(k)) {
        if (!valid(x, props[k], root)) return false;
      } else if (s.contains("additionalProperties") && !valid(x, s["additionalProperties"], root)) {
        return false;
      }
    }
  }
  if (v.is_array()) {
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return false;
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
    if (s.contains("items"))
      for (const auto& x : v)
        if (!valid(x, s["items"], root)) return false;
  }
  if (v.is_string()) {
    const std::string str = v.get<std::string>();
    if (s.contains("minLength") && code_points(str) < s["minLength"].get<size_t>()) return false;
    if (s.contains("maxLength") && code_points(str) > s["maxLength"].get<size_t>()) return false;
    const std::string date = R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))";
    const std::string time = R"(([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))";
    const std::map<std::string, std::string> formats = {
        {"date", date}, {"time", time}, {"date-time", date + "T" + time},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}};
    if (s.contains("format") && formats.count(s["format"].get<std::string>()) &&
        !std::regex_match(str, std::regex(formats.at(s["format"].get<std::string>()))))
      return false;
  }
  return true;
}

// Each schema with one value it admits and one it does not: the validator
// itself is checked before it judges the model's output.
struct Schema {
  const char* schema;
  const char* good;
  const char* bad;
};

const std::vector<Schema>& schemas() {
  static const std::vector<Schema> s = {
      {R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": false})",
       R"({"name": "Ann", "age": 3})", R"({"name": "Ann", "age": 3, "x": 1})"},
      {R"({"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 4})", "[1, 2.5]", "[1]"},
      {R"({"enum": ["red", "green", "blue", 7, null]})", R"("green")", R"("pink")"},
      {R"({"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "number"}, "y": {"type": "number"}},
          "required": ["kind", "x", "y"]})",
       R"({"kind": "point", "x": 1, "y": -2e3})", R"({"kind": "line", "x": 1, "y": 2})"},
      {R"({"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}}, "required": ["ok", "note"]})",
       R"({"ok": false, "note": null})", R"({"ok": 0, "note": null})"},
      {R"({"type": ["string", "null"], "maxLength": 8})", "null", R"("far too long")"},
      {R"({"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}]})",
       R"({"id": 4})", "1.5"},
      {R"({"oneOf": [{"type": "object", "properties": {"cat": {"type": "string", "maxLength": 6}}, "required": ["cat"],
           "additionalProperties": false},
          {"type": "object", "properties": {"dog": {"type": "integer"}}, "required": ["dog"], "additionalProperties": false}]})",
       R"({"dog": 2})", R"({"cat": "a", "dog": 2})"},
      {R"({"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
          "required": ["x", "y"]}}, "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 3})",
       R"([{"x": 1, "y": 2}])", R"([{"x": 1}])"},
      {R"({"definitions": {"tag": {"type": "string", "minLength": 1, "maxLength": 5}}, "type": "object",
          "properties": {"tags": {"type": "array", "items": {"$ref": "#/definitions/tag"}, "minItems": 1, "maxItems": 3}},
          "required": ["tags"]})",
       R"({"tags": ["a"]})", R"({"tags": [""]})"},
      {R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}},
          "$ref": "#/$defs/node"})",
       R"({"v": 1, "kids": [{"v": 2}]})", R"({"v": 1, "kids": [{"w": 2}]})"},
      {R"({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
          "additionalProperties": {"type": "integer"}})",
       R"({"id": 1, "n": 2})", R"({"id": 1, "n": "2"})"},
      {R"({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "additionalProperties": true})",
       R"({"a": "x", "b": [1]})", R"({"a": 1})"},
      {R"({"type": "string", "minLength": 3, "maxLength": 6})", R"("abc")", R"("ab")"},
      {R"({"type": "object", "properties": {"when": {"type": "string", "format": "date"},
          "at": {"type": "string", "format": "date-time"}}, "required": ["when", "at"]})",
       R"({"when": "2024-01-31", "at": "2024-01-31T10:00:00Z"})", R"({"when": "2024-31-01", "at": "2024-01-31T10:00:00Z"})"},
      {R"({"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}, "t": {"type": "string", "format": "time"}},
          "required": ["id", "t"]})",
       R"({"id": "123e4567-e89b-12d3-a456-426614174000", "t": "10:00:00+01:00"})",
       R"({"id": "123e4567", "t": "10:00:00+01:00"})"},
      {R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5},
          "c": {"type": "boolean"}}, "required": ["c"]})",
       R"({"c": true})", R"({"a": 1})"},
      {R"({"allOf": [{"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}], "title": "wrapped"})",
       R"({"n": 0})", R"({"m": 0})"},
      {R"({"type": "object", "properties": {"user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
          "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
          "zip": {"type": "string", "minLength": 5, "maxLength": 5}}, "required": ["city", "zip"]}},
          "required": ["name", "address"]}}, "required": ["user"]})",
       R"({"user": {"name": "A", "address": {"city": "B", "zip": "12345"}}})",
       R"({"user": {"name": "A", "address": {"city": "B", "zip": "1234"}}})"},
      {R"({"type": ["integer", "boolean"]})", "true", R"("true")"},
  };
  return s;
}

struct Model {
  std::unique_ptr<QwenModel> model;
  Tokenizer tok;
  std::shared_ptr<const TokenVocabulary> trie;
};

Model& coder_mini() {
  static Model m = [] {
    const std::string dir = source_path("models/coder-mini");
    Model x{QwenModel::load(dir + "/model"), Tokenizer::load(dir), nullptr};
    x.trie = std::make_shared<const TokenVocabulary>(x.tok);
    return x;
  }();
  return m;
}

GenerateResult run(const json& response_format, float temperature, uint64_t seed, int max_tokens,
                   std::vector<std::string> stop = {}) {
  Model& m = coder_mini();
  ThreadPool pool(2);
  Session s(cpu_of(*m.model), KvConfig{}, pool);
  auto c = make_json_constraint(response_format, m.trie);
  GenerateOptions o;
  o.max_new_tokens = max_tokens;
  o.sampling.temperature = temperature;
  o.sampling.seed = seed;
  o.sampling.eos_ids = {4091};
  o.constraint = c.get();
  o.stop = std::move(stop);
  return generate(s, m.tok, m.tok.encode("# the record as JSON\nrecord = "), o, [](const std::string&) { return true; });
}

}  // namespace

TEST(JsonOutput, ValidatorAgreesWithHandPickedValues) {
  ASSERT_EQ(schemas().size(), 20u);  // and json_object: 21 formats
  for (const Schema& s : schemas()) {
    const json schema = json::parse(s.schema);
    EXPECT_TRUE(valid(json::parse(s.good), schema, schema)) << s.schema << "\n" << s.good;
    EXPECT_FALSE(valid(json::parse(s.bad), schema, schema)) << s.schema << "\n" << s.bad;
  }
}

TEST(JsonOutput, CoderMiniOutputParsesAndValidates) {
  // Under the sanitizers every step is ~20x slower: the first 6 schemas, greedy.
  const size_t n = sanitizer_build() ? 6 : schemas().size();
  const int max_tokens = 80;
  for (size_t i = 0; i <= n; ++i) {
    const bool object = i == n;  // the last round: json_object
    const json schema = object ? json::object() : json::parse(schemas()[i].schema);
    const json rf = object ? json{{"type", "json_object"}}
                           : json{{"type", "json_schema"}, {"json_schema", {{"name", "s"}, {"schema", schema}}}};
    for (const float temperature : {0.0f, 0.9f}) {
      if (temperature > 0 && sanitizer_build()) continue;
      SCOPED_TRACE("schema " + std::to_string(i) + " at temperature " + std::to_string(temperature) + ": " + rf.dump());
      const GenerateResult r = run(rf, temperature, 1234 + i, max_tokens);
      EXPECT_EQ(r.finish_reason, "stop") << r.text;
      EXPECT_LE(r.generated, max_tokens);
      json v;
      ASSERT_NO_THROW(v = json::parse(r.text)) << r.text;
      if (object) EXPECT_TRUE(v.is_object()) << r.text;
      else EXPECT_TRUE(valid(v, schema, schema)) << r.text;
    }
  }
}

// Without the constraint the same model writes Python, not JSON: the test
// above passes because of the constraint.
TEST(JsonOutput, UnconstrainedCoderMiniIsNotJson) {
  Model& m = coder_mini();
  ThreadPool pool(2);
  Session s(cpu_of(*m.model), KvConfig{}, pool);
  GenerateOptions o;
  o.max_new_tokens = 24;
  o.sampling.temperature = 0;
  o.sampling.eos_ids = {4091};
  const GenerateResult r =
      generate(s, m.tok, m.tok.encode("# the record as JSON\nrecord = "), o, [](const std::string&) { return true; });
  json v;
  EXPECT_THROW(v = json::parse(r.text), json::exception) << r.text;
}

// A tight token budget still ends with a complete value: the constraint
// steers toward the shortest completion once the budget requires it.
TEST(JsonOutput, TightBudgetStillCompletes) {
  const json schema = json::parse(schemas()[0].schema);
  const json rf = {{"type", "json_schema"}, {"json_schema", {{"name", "s"}, {"schema", schema}}}};
  // The shortest value, {"name":"","age":0}, is 20 bytes; coder-mini's
  // tokens make it in fewer, and 24 tokens leave room for one at a time.
  const GenerateResult r = run(rf, 0.9f, 5, 24);
  EXPECT_EQ(r.finish_reason, "stop") << r.text;
  json v;
  ASSERT_NO_THROW(v = json::parse(r.text)) << r.text;
  EXPECT_TRUE(valid(v, schema, schema)) << r.text;
}

// The closing brace is held back while it might begin the stop string
// "}\n\n"; the EOS that follows must release it, not drop it.
TEST(JsonOutput, EosReleasesTextHeldForAStopString) {
  const json rf = {{"type", "json_object"}};
  const GenerateResult r = run(rf, 0.0f, 1, 40, {"}\n\n"});
  EXPECT_EQ(r.finish_reason, "stop");
  json v;
  ASSERT_NO_THROW(v = json::parse(r.text)) << r.text;
  EXPECT_TRUE(v.is_object());
}

}  // namespace json_output_test
