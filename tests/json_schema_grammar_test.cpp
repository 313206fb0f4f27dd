// The JSON Schema -> grammar compiler, keyword by keyword: texts derived by
// hand from the JSON Schema and RFC 8259 rules that the grammar must accept
// (valid, in the generated form) and refuse (invalid, or valid but outside
// the bounded form: extra whitespace, other property order).
#include <gtest/gtest.h>

#include "engine/json_schema_grammar.h"

namespace json_schema_grammar_test {

using namespace flashmoe;
using json = nlohmann::ordered_json;

namespace {

bool accepts(const Grammar& g, std::string_view text) {
  GrammarMatcher m(g);
  return m.feed(text) && m.accepting();
}

struct Case {
  const char* schema;
  std::vector<std::string> good, bad;
};

void check(const Case& c) {
  SCOPED_TRACE(c.schema);
  const Grammar g = json_schema_grammar(json::parse(c.schema));
  for (const auto& t : c.good) EXPECT_TRUE(accepts(g, t)) << "should accept: " << t << "\n" << g.to_string();
  for (const auto& t : c.bad) EXPECT_FALSE(accepts(g, t)) << "should refuse: " << t << "\n" << g.to_string();
}

std::string schema_error(const char* schema) {
  try {
    json_schema_grammar(json::parse(schema));
  } catch (const JsonSchemaError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(JsonSchemaGrammar, Scalars) {
  check({R"({"type": "string"})",
         {R"("")", R"("abc")", R"("a\"b")", R"("\\ \/ \b\f\n\r\t")", R"("\u00e9\uFFFF")", "\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"", "\"\x7F\""},
         {"abc", R"("a)", R"("a"b)", "\"\x01\"", "\"a\nb\"", R"("\ud800")", R"("\x")", R"("\u12")",
          "\"\xC3(\"", "\"\xED\xA0\x80\"", "\"\xC0\xAF\"", "\"\xF5\x80\x80\x80\"", "\"\x80\""}});
  check({R"({"type": "number"})",
         {"0", "-1.5", "1e10", "2.5E-3", "123", "-0", "1e+007", "1234567890123456", "0.1234567890123456"},
         {"01", "1.", ".5", "+1", "1e", "12345678901234567", "0.12345678901234567", "1e1234", "- 1", "1 ", "NaN"}});
  check({R"({"type": "integer"})", {"0", "-42", "9"}, {"1.0", "1e3", "-", "00"}});
  check({R"({"type": "boolean"})", {"true", "false"}, {"True", "1", "tru", "null"}});
  check({R"({"type": "null"})", {"null"}, {"nul", "0", "\"null\""}});
  check({R"({"type": ["string", "null"]})", {R"("x")", "null"}, {"1", "true"}});
}

TEST(JsonSchemaGrammar, ObjectPropertiesRequiredAndWhitespace) {
  const char* s = R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                     "required": ["a"]})";
  check({s,
         {R"({"a":1})", R"({"a": 1, "b": "x"})", R"({"a":1,"b":"x"})"},
         {R"({"b":"x"})", R"({"b":"x","a":1})", "{}", R"({"a":1,"c":2})", R"({ "a":1})", R"({"a":  1})",
          R"({"a":1 })", R"({"a" :1})", R"({"a":1,})", "{\"a\":\n1}"}});
  // An optional property before a required one; and all optional.
  check({R"({"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]})",
         {R"({"b":"x"})", R"({"a":1,"b":"x"})"},
         {R"({"a":1})", "{}", R"({,"b":"x"})"}});
  check({R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}})",
         {"{}", R"({"a":1})", R"({"b":true})", R"({"a":1, "b":false})"},
         {R"({"b":true,"a":1})", R"({,})"}});
  // A property name that needs escaping is written escaped.
  check({R"({"type": "object", "properties": {"q\"k": {"type": "null"}}, "required": ["q\"k"]})",
         {R"({"q\"k":null})"}, {R"({"q"k":null})"}});
}

TEST(JsonSchemaGrammar, AdditionalProperties) {
  // Absent: none generated (a subset of what the schema allows).
  check({R"({"type": "object", "properties": {"a": {"type": "integer"}}})", {R"({"a":1})"}, {R"({"x":1})"}});
  check({R"({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": false})",
         {R"({"a":1})", "{}"}, {R"({"x":1})"}});
  check({R"({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": true})",
         {R"({"a":1,"z":[1,{}, "s", null]})", R"({"z":null})", "{}", R"({"a":1})", R"({"x":{"y":[true]},"w":-2.5e3})"},
         {R"({"a":"s"})", R"({"z"})", R"({"z":})"}});
  // An additional property never repeats a declared name, not even spelled
  // with an escape; other names, also ones starting like a declared one, are
  // fine.
  check({R"({"type": "object", "properties": {"ab": {"type": "integer"}, "é": {"type": "null"}},
             "additionalProperties": {"type": "string"}})",
         {R"({"ab":1,"abc":"x"})", R"({"a":"x"})", R"({"":"x"})", R"({"b\u0061":"x"})",
          "{\"\xC3\xA9\":null,\"\xC3\xA9\xC3\xA9\":\"x\"}", "{\"\xE2\x82\xAC\":\"x\"}"},
         {R"({"ab":"x"})", R"({"ab":1,"ab":"x"})", R"({"\u0061b":"x"})", "{\"\xC3\xA9\":\"x\"}"}});
  check({R"({"type": "object", "additionalProperties": {"type": "integer"}})",
         {R"({"x":1,"y":2})", "{}"}, {R"({"x":"s"})", R"({"x":1,"y":null})"}});
}

TEST(JsonSchemaGrammar, ArraysItemsMinMax) {
  check({R"({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3})",
         {"[1]", "[1,2,3]", "[1, 2]"},
         {"[]", "[1,2,3,4]", R"(["a"])", "[1,]", "[ 1]"}});
  check({R"({"type": "array", "items": {"type": "integer"}, "minItems": 2})",
         {"[1,2]", "[1,2,3,4,5,6,7,8,9,10]"}, {"[1]", "[]"}});
  check({R"({"type": "array", "maxItems": 0})", {"[]"}, {"[1]"}});
  check({R"({"type": "array"})", {"[]", R"([1,"a",{"b":[null]},true])"}, {"[", "{}"}});
  check({R"({"type": "array", "items": {"type": "string"}, "maxItems": 2})",
         {"[]", R"(["a"])", R"(["a","b"])"}, {R"(["a","b","c"])"}});
}

TEST(JsonSchemaGrammar, EnumConstAnyOfOneOf) {
  check({R"({"enum": ["red", "green", 1, null, {"k": [true]}]})",
         {R"("red")", R"("green")", "1", "null", R"({"k":[true]})"},
         {R"("blue")", R"("re")", "2", R"({"k": [true]})"}});
  check({R"({"type": "string", "enum": ["a", 1]})", {R"("a")"}, {"1"}});  // type filters enum
  check({R"({"const": "fixed"})", {R"("fixed")"}, {R"("fixe")", R"("fixedd")"}});
  check({R"({"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}]})",
         {"5", R"({"x":true})"}, {R"("s")", "{}"}});
  check({R"({"oneOf": [{"type": "string", "maxLength": 1}, {"type": "array", "items": {"type": "null"}}]})",
         {R"("a")", "[null,null]", "[]"}, {R"("ab")", "[1]"}});
  check({R"({"allOf": [{"type": "boolean"}], "title": "t"})", {"true"}, {"1"}});
}

TEST(JsonSchemaGrammar, References) {
  check({R"({"$defs": {"p": {"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}},
             "type": "array", "items": {"$ref": "#/$defs/p"}})",
         {R"([{"n":"a"},{"n":"b"}])", "[]"}, {R"([{"m":"a"}])"}});
  check({R"({"definitions": {"c": {"enum": ["x", "y"]}}, "type": "object",
             "properties": {"c": {"$ref": "#/definitions/c"}}, "required": ["c"]})",
         {R"({"c":"x"})"}, {R"({"c":"z"})"}});
  // Recursion through a definition and through the root.
  check({R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
             "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
             "$ref": "#/$defs/node"})",
         {R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[]}]})", R"({"v":1})"},
         {R"({"v":1,"kids":[{"kids":[]}]})"}});
  check({R"({"type": "object", "properties": {"c": {"$ref": "#"}}})", {R"({"c":{"c":{}}})", "{}"}, {R"({"c":1})"}});
}

TEST(JsonSchemaGrammar, StringLengthsAndFormats) {
  check({R"({"type": "string", "minLength": 2, "maxLength": 3})",
         {R"("ab")", R"("abc")", "\"\xC3\xA9\xE2\x82\xAC\"", R"("a\n")", R"("\u0041\u0042\u0043")"},
         {R"("a")", R"("abcd")", R"("")", "\"\xC3\xA9\"", R"("\u0041\u0042\u0043\u0044")"}});
  check({R"({"type": "string", "format": "date"})",
         {R"("2024-02-29")", R"("1999-12-31")"}, {R"("2024-13-01")", R"("24-01-01")", R"("2024-01-32")", R"("2024-1-01")"}});
  check({R"({"type": "string", "format": "time"})",
         {R"("12:30:00Z")", R"("23:59:59.123+02:00")"}, {R"("24:00:00Z")", R"("12:30:00")", R"("12:60:00Z")"}});
  check({R"({"type": "string", "format": "date-time"})",
         {R"("2024-01-01T00:00:00Z")", R"("2024-06-30T12:00:00.5-05:30")"}, {R"("2024-01-01 00:00:00Z")"}});
  check({R"({"type": "string", "format": "uuid"})",
         {R"("123e4567-e89b-12d3-a456-426614174000")"}, {R"("123e4567-e89b-12d3-a456-42661417400")", R"("g23e4567-e89b-12d3-a456-426614174000")"}});
  check({R"({"type": "string", "format": "email"})", {R"("anything at all")"}, {"1"}});  // annotation only
}

TEST(JsonSchemaGrammar, AnyJsonObject) {
  const Grammar g = json_object_grammar();
  for (const char* t : {"{}", R"({"a":[1,"x",{"b":null}],"c":true})", R"({"a": -0.5e3, "b": []})"})
    EXPECT_TRUE(accepts(g, t)) << t;
  for (const char* t : {"[]", "1", R"({"a"})", R"({"a":})", R"("s")", R"({'a':1})", "{} "}) EXPECT_FALSE(accepts(g, t)) << t;
}

TEST(JsonSchemaGrammar, ShortestCompletion) {
  const Grammar g = json_schema_grammar(json::parse(
      R"({"type": "object", "properties": {"a": {"type": "integer"}, "s": {"type": "string", "minLength": 3}},
          "required": ["a", "s"]})"));
  GrammarMatcher m(g);
  // {"a":0,"s":"xxx"} is the shortest value: 17 bytes.
  EXPECT_EQ(m.stacks().min_bytes_to_accept(g), 17u);
  ASSERT_TRUE(m.feed(R"({"a":)"));
  EXPECT_EQ(m.stacks().min_bytes_to_accept(g), 12u);  // 0,"s":"xxx"}
  ASSERT_TRUE(m.feed(R"(12,"s":"\u00)"));
  EXPECT_EQ(m.stacks().min_bytes_to_accept(g), 6u);   // 2 hex digits, 2 characters, quote, brace
  ASSERT_TRUE(m.feed(R"(e9ab"})"));
  EXPECT_EQ(m.stacks().min_bytes_to_accept(g), 0u);
  EXPECT_TRUE(m.accepting());
  EXPECT_FALSE(m.can_continue());
}

// A long enum of similar strings is followed as a trie, not as thousands of
// parses;
// limits keep a request from opening more parses than that.
TEST(JsonSchemaGrammar, LargeEnumsShareTheirPrefixes) {
  json values = json::array();
  for (int i = 0; i < 3000; ++i) values.push_back("item-" + std::to_string(i));
  const Grammar g = json_schema_grammar(json{{"enum", values}});
  GrammarMatcher m(g);
  ASSERT_TRUE(m.feed("\"item-12"));
  // One parse per possible next byte (0-9 and the quote), not one per
  // value still possible (111: item-12, item-120..129, item-1200..1299).
  EXPECT_EQ(m.stacks().size(), 11u);
  EXPECT_TRUE(accepts(g, "\"item-1234\""));
  EXPECT_TRUE(accepts(g, "\"item-12\""));
  EXPECT_FALSE(accepts(g, "\"item-3000\""));
  json any = json::array();
  for (int i = 0; i < 65; ++i) any.push_back({{"const", i}});
  EXPECT_THROW(json_schema_grammar(json{{"anyOf", any}}), JsonSchemaError);
  json props = json::object();
  for (int i = 0; i < 513; ++i) props["p" + std::to_string(i)] = json{{"type", "null"}};
  EXPECT_THROW(json_schema_grammar(json{{"type", "object"}, {"properties", props}}), JsonSchemaError);
}

TEST(JsonSchemaGrammar, ErrorsNameTheKeyword) {
  auto has = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << msg << "\n  should contain: " << part;
  };
  has(schema_error(R"({"type": "string", "pattern": "^a+$"})"), "'pattern' is not supported");
  has(schema_error(R"({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}})"),
      "'minimum' is not supported (at #/properties/n)");
  has(schema_error(R"({"type": "array", "prefixItems": []})"), "'prefixItems'");
  has(schema_error(R"({"not": {"type": "null"}})"), "'not'");
  has(schema_error(R"({"$ref": "http://example.com/s.json"})"), "only references inside the schema");
  has(schema_error(R"({"$ref": "#/$defs/missing"})"), "points at nothing");
  has(schema_error(R"({"allOf": [{"type": "string"}, {"maxLength": 2}]})"), "'allOf' is supported only with exactly one");
  has(schema_error(R"({"type": "text"})"), "unknown type 'text'");
  has(schema_error(R"({"type": "object", "properties": {}, "required": ["x"]})"), "required property 'x'");
  has(schema_error(R"({"type": "array", "minItems": 3, "maxItems": 2})"), "'minItems' is larger than 'maxItems'");
  has(schema_error(R"({"type": "string", "minLength": -1})"), "'minLength' must be a non-negative integer");
  has(schema_error("false"), "accepts nothing");
  has(schema_error(R"({"type": "string", "$ref": "#"})"), "'$ref' together with 'type'");
  has(schema_error(R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"})"),
      "reaches itself");
  has(schema_error(R"({"type": "object", "properties": {"s": {"$ref": "#"}}, "required": ["s"]})"),
      "no value can satisfy the schema");
  has(schema_error(R"({"enum": []})"), "'enum' must be a non-empty array");
  has(schema_error(R"({"type": "integer", "enum": ["a"]})"), "no value of 'enum'/'const' has the schema's 'type'");
}

}  // namespace json_schema_grammar_test
