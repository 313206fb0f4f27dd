// response_format through `flashmoe serve` (coder-mini): json_schema and
// json_object answers parse and match, streamed and not; a schema the
// server cannot enforce is a 400 naming the keyword, and the server keeps
// serving.
#include "server_process.h"

namespace server_json_test {

using namespace flashmoe::test::serve;

namespace {

json schema_format() {
  return {{"type", "json_schema"},
          {"json_schema",
           {{"name", "point"},
            {"strict", true},
            {"schema",
             {{"type", "object"},
              {"properties", {{"x", {{"type", "integer"}}}, {"label", {{"enum", {"a", "b"}}}}}},
              {"required", {"x", "label"}},
              {"additionalProperties", false}}}}}};
}

}  // namespace

TEST(ServerJson, SchemaAndObjectOutputParse) {
  ServerProcess srv(standard_args());
  ASSERT_NE(srv.port(), 0) << srv.failure_log();
  auto c = srv.client();
  int status = 0;
  json body = chat_body({{"user", "a point"}}, 48);
  body["response_format"] = schema_format();
  json r = post_json(c, "/v1/chat/completions", body, &status);
  ASSERT_EQ(status, 200) << r.dump();
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  const std::string text = r["choices"][0]["message"]["content"];
  json v = json::parse(text, nullptr, false);
  ASSERT_TRUE(v.is_object()) << text;
  // Keys in the schema's order; nlohmann::json sorts, so check the members.
  EXPECT_EQ(v.size(), 2u) << text;
  EXPECT_TRUE(v["x"].is_number_integer()) << text;
  EXPECT_TRUE(v["label"] == "a" || v["label"] == "b") << text;

  // Streamed: the deltas put together are the same text.
  body["stream"] = true;
  auto s = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200);
  std::string streamed;
  for (size_t i = 0; (i = s->body.find("data: {", i)) != std::string::npos; ++i) {
    json e = json::parse(s->body.substr(i + 6, s->body.find("\n\n", i) - i - 6));
    if (e["choices"][0]["delta"].contains("content")) streamed += e["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(streamed, text);

  json obj = chat_body({{"user", "anything"}}, 40);
  obj["response_format"] = {{"type", "json_object"}};
  r = post_json(c, "/v1/chat/completions", obj, &status);
  ASSERT_EQ(status, 200) << r.dump();
  const std::string otext = r["choices"][0]["message"]["content"];
  if (r["choices"][0]["finish_reason"] == "stop") EXPECT_TRUE(json::parse(otext, nullptr, false).is_object()) << otext;
  else EXPECT_EQ(otext.substr(0, 1), "{");  // cut by max_tokens, as OpenAI does
}

TEST(ServerJson, UnsupportedSchemaIs400NamingTheKeyword) {
  ServerProcess srv(standard_args());
  ASSERT_NE(srv.port(), 0) << srv.failure_log();
  auto c = srv.client();
  int status = 0;
  json body = chat_body({{"user", "x"}});
  body["response_format"] = {{"type", "json_schema"},
                             {"json_schema", {{"name", "s"}, {"schema", {{"type", "string"}, {"pattern", "^a$"}}}}}};
  json r = post_json(c, "/v1/chat/completions", body, &status);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(r["error"]["param"], "response_format");
  EXPECT_NE(r["error"]["message"].get<std::string>().find("'pattern' is not supported"), std::string::npos) << r.dump();
  body["response_format"] = {{"type", "xml"}};
  r = post_json(c, "/v1/chat/completions", body, &status);
  EXPECT_EQ(status, 400);
  EXPECT_NE(r["error"]["message"].get<std::string>().find("'response_format.type'"), std::string::npos) << r.dump();
  body["response_format"] = {{"type", "text"}};
  r = post_json(c, "/v1/chat/completions", body, &status);
  EXPECT_EQ(status, 200) << r.dump();
}

}  // namespace server_json_test
