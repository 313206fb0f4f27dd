#include "engine/json_schema_grammar.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

namespace flashmoe {

namespace {

using json = nlohmann::ordered_json;
using Seq = GrammarBuilder::Seq;
using Element = Grammar::Element;
constexpr uint32_t kUnbounded = Grammar::kUnbounded;

// Digits a generated number may have: enough for any double, few enough
// that a model cannot emit digits forever.
constexpr uint32_t kIntDigits = 16, kFracDigits = 16, kExpDigits = 3;
// minItems / maxItems unroll into one rule per element.
constexpr uint64_t kMaxCountedItems = 4096;
constexpr size_t kMaxRules = 200000;
// anyOf/oneOf alternatives are followed at once while they agree; bounded
// so that one request cannot make every byte cost thousands of parses.
constexpr size_t kMaxAlternatives = 64;
// Optional properties are alternatives too: after each member, every later
// optional one may come next.
constexpr size_t kMaxProperties = 512;

const std::set<std::string>& annotations() {
  static const std::set<std::string> s = {"title",    "description", "default",  "examples", "$schema",
                                          "$id",      "$comment",    "deprecated", "readOnly", "writeOnly"};
  return s;
}

const std::set<std::string>& supported() {
  static const std::set<std::string> s = {"type",     "properties", "required",  "additionalProperties",
                                          "items",    "minItems",   "maxItems",  "enum",
                                          "const",    "anyOf",      "oneOf",     "allOf",
                                          "$ref",     "$defs",      "definitions", "minLength",
                                          "maxLength", "format"};
  return s;
}

[[noreturn]] void error(const std::string& path, const std::string& msg) {
  throw JsonSchemaError("response_format schema: " + msg + " (at " + path + ")");
}

bool value_has_type(const json& v, const std::string& t) {
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "string") return v.is_string();
  if (t == "number") return v.is_number();
  if (t == "integer")
    return v.is_number_integer() || (v.is_number_float() && v.get<double>() == double(int64_t(v.get<double>())));
  if (t == "boolean") return v.is_boolean();
  if (t == "null") return v.is_null();
  return false;
}

class Compiler {
 public:
  explicit Compiler(const json& root) : root_(root) {}

  Grammar schema_grammar() {
    const uint32_t r = compile(root_, "#");
    Grammar g = b_.finish(r);
    if (g.min_length(g.root) == Grammar::kUnbounded)
      error("#", "no value can satisfy the schema in finitely many bytes (a required recursion never ends)");
    return g;
  }
  Grammar object_grammar() { return b_.finish(any_object()); }

 private:
  const json& root_;
  GrammarBuilder b_;
  std::map<std::string, uint32_t> refs_;
  // The $refs being compiled since the last '{' or '[': one of them
  // reached again would recurse without consuming input.
  std::vector<std::string> alias_chain_;
  std::optional<uint32_t> ws_, value_, object_, array_, string_, number_, integer_, boolean_, null_;
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> up_to_;  // (byte set, n) -> rule: up to n more

  uint32_t rule(const std::string& name) {
    if (++rules_ > kMaxRules) error("#", "the schema needs more than " + std::to_string(kMaxRules) + " grammar rules");
    return b_.new_rule(name);
  }
  size_t rules_ = 0;

  uint32_t once(std::optional<uint32_t>& slot, const char* name, const std::vector<Seq>& alts) {
    if (!slot) {
      slot = rule(name);
      for (const Seq& s : alts) b_.add_alternative(*slot, s);
    }
    return *slot;
  }
  Seq lit(std::string_view text) {
    Seq s;
    b_.append_literal(s, text);
    return s;
  }
  static Seq cat(Seq a, const Seq& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  static Element ref(uint32_t r) { return GrammarBuilder::ref(r); }

  // ---- fixed pieces ----

  uint32_t ws() { return once(ws_, "ws", {lit(" "), {}}); }
  Seq comma() { return {b_.byte(','), ref(ws())}; }
  Seq colon() { return {b_.byte(':'), ref(ws())}; }

  // Up to n more elements `e` (a chain of optional rules).
  uint32_t up_to(const Element& e, uint32_t n) {
    auto key = std::make_pair(e.arg, n);
    if (auto it = up_to_.find(key); it != up_to_.end()) return it->second;
    const uint32_t r = rule("up-to-" + std::to_string(n));
    up_to_[key] = r;
    b_.add_alternative(r, {});
    if (n > 0) b_.add_alternative(r, {e, ref(up_to(e, n - 1))});
    return r;
  }
  // Between lo and hi copies of e.
  Seq repeat(const Element& e, uint32_t lo, uint32_t hi) {
    Seq s(lo, e);
    if (hi > lo) s.push_back(ref(up_to(e, hi - lo)));
    return s;
  }
  Element digit() { return b_.byte_range('0', '9'); }

  uint32_t string_any() { return once(string_, "string", {{b_.byte('"'), GrammarBuilder::string_body(0, kUnbounded)}}); }
  uint32_t boolean() { return once(boolean_, "boolean", {lit("true"), lit("false")}); }
  uint32_t null() { return once(null_, "null", {lit("null")}); }

  uint32_t int_part() {
    const uint32_t r = rule("int-part");
    b_.add_alternative(r, lit("0"));
    b_.add_alternative(r, cat({b_.byte_range('1', '9')}, repeat(digit(), 0, kIntDigits - 1)));
    return r;
  }
  uint32_t integer() {
    if (!integer_) {
      const uint32_t ip = int_part();
      integer_ = rule("integer");
      b_.add_alternative(*integer_, {ref(ip)});
      b_.add_alternative(*integer_, {b_.byte('-'), ref(ip)});
    }
    return *integer_;
  }
  uint32_t number() {
    if (!number_) {
      const uint32_t frac = rule("fraction");
      b_.add_alternative(frac, {});
      b_.add_alternative(frac, cat({b_.byte('.')}, repeat(digit(), 1, kFracDigits)));
      const uint32_t exp = rule("exponent");
      b_.add_alternative(exp, {});
      const Seq digits = repeat(digit(), 1, kExpDigits);
      const Element e = b_.bytes(std::bitset<256>().set('e').set('E'));
      b_.add_alternative(exp, cat({e}, digits));
      b_.add_alternative(exp, cat({e, b_.bytes(std::bitset<256>().set('+').set('-'))}, digits));
      number_ = rule("number");
      b_.add_alternative(*number_, {ref(integer()), ref(frac), ref(exp)});
    }
    return *number_;
  }

  uint32_t any_value() {
    if (!value_) {
      value_ = rule("value");
      for (uint32_t r : {any_object(), any_array(), string_any(), number(), boolean(), null()})
        b_.add_alternative(*value_, {ref(r)});
    }
    return *value_;
  }
  uint32_t any_object() {
    if (!object_) {
      object_ = rule("object");
      const uint32_t member = rule("member"), more = rule("members");
      b_.add_alternative(*object_, lit("{}"));
      b_.add_alternative(*object_, {b_.byte('{'), ref(member), ref(more), b_.byte('}')});
      b_.add_alternative(member, cat(cat({ref(string_any())}, colon()), {ref(any_value())}));
      b_.add_alternative(more, {});
      b_.add_alternative(more, cat(comma(), {ref(member), ref(more)}));
    }
    return *object_;
  }
  uint32_t any_array() {
    if (!array_) {
      array_ = rule("array");
      const uint32_t more = rule("elements");
      b_.add_alternative(*array_, lit("[]"));
      b_.add_alternative(*array_, {b_.byte('['), ref(any_value()), ref(more), b_.byte(']')});
      b_.add_alternative(more, {});
      b_.add_alternative(more, cat(comma(), {ref(any_value()), ref(more)}));
    }
    return *array_;
  }

  // ---- schema ----

  std::optional<uint64_t> count(const json& s, const char* key, const std::string& path) {
    auto it = s.find(key);
    if (it == s.end()) return std::nullopt;
    if (it->is_number_unsigned()) return it->get<uint64_t>();
    if (it->is_number_integer() && it->get<int64_t>() >= 0) return uint64_t(it->get<int64_t>());
    if (it->is_number_float()) {
      const double d = it->get<double>();
      if (d >= 0 && d < 1e15 && d == double(uint64_t(d))) return uint64_t(d);
    }
    error(path, std::string("'") + key + "' must be a non-negative integer");
  }

  uint32_t compile(const json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return any_value();
      error(path, "the schema false accepts nothing");
    }
    if (!s.is_object()) error(path, "a schema must be an object or a boolean");
    std::vector<std::string> keys;  // the keywords that constrain the value
    for (const auto& [k, v] : s.items()) {
      if (annotations().count(k)) continue;
      if (!supported().count(k)) error(path, "the keyword '" + k + "' is not supported");
      if (k == "$defs" || k == "definitions") {
        if (!v.is_object()) error(path + "/" + k, "'" + k + "' must be an object");
        continue;
      }
      keys.push_back(k);
    }
    auto alone = [&](const std::string& k) {
      for (const auto& other : keys)
        if (other != k) error(path, "'" + k + "' together with '" + other + "' is not supported");
    };
    if (s.contains("$ref")) {
      alone("$ref");
      return reference(s["$ref"], path);
    }
    if (s.contains("allOf")) {
      alone("allOf");
      const json& a = s["allOf"];
      if (!a.is_array() || a.size() != 1) error(path, "'allOf' is supported only with exactly one schema");
      return compile(a[0], path + "/allOf/0");
    }
    for (const char* k : {"anyOf", "oneOf"}) {
      if (!s.contains(k)) continue;
      alone(k);
      const json& a = s[k];
      if (!a.is_array() || a.empty()) error(path, std::string("'") + k + "' must be a non-empty array of schemas");
      if (a.size() > kMaxAlternatives)
        error(path, std::string("'") + k + "' with more than " + std::to_string(kMaxAlternatives) +
                        " schemas is not supported");
      const uint32_t r = rule(path);
      for (size_t i = 0; i < a.size(); ++i)
        b_.add_alternative(r, {ref(compile(a[i], path + "/" + k + "/" + std::to_string(i)))});
      return r;
    }

    std::vector<std::string> types;
    if (auto it = s.find("type"); it != s.end()) {
      if (it->is_string()) types.push_back(it->get<std::string>());
      else if (it->is_array() && !it->empty())
        for (const auto& t : *it) {
          if (!t.is_string()) error(path, "'type' must be a string or an array of strings");
          types.push_back(t.get<std::string>());
        }
      else error(path, "'type' must be a string or a non-empty array of strings");
      for (const auto& t : types)
        if (!std::set<std::string>{"object", "array", "string", "number", "integer", "boolean", "null"}.count(t))
          error(path, "unknown type '" + t + "'");
    }

    if (s.contains("const") || s.contains("enum")) {
      std::vector<json> values;
      if (s.contains("const")) values.push_back(s["const"]);
      else {
        const json& e = s["enum"];
        if (!e.is_array() || e.empty()) error(path, "'enum' must be a non-empty array");
        values.assign(e.begin(), e.end());
      }
      std::vector<std::string> texts;
      for (const json& v : values)
        if (types.empty() ||
            std::any_of(types.begin(), types.end(), [&](const std::string& t) { return value_has_type(v, t); }))
          texts.push_back(v.dump());
      if (texts.empty()) error(path, "no value of 'enum'/'const' has the schema's 'type'");
      return literals(texts, path);
    }

    if (types.empty()) {  // inferred from the keywords, as a validator reads them
      auto any_of = [&](std::initializer_list<const char*> ks) {
        return std::any_of(ks.begin(), ks.end(), [&](const char* k) { return s.contains(k); });
      };
      if (any_of({"properties", "required", "additionalProperties"})) types.push_back("object");
      if (any_of({"items", "minItems", "maxItems"})) types.push_back("array");
      if (any_of({"minLength", "maxLength", "format"})) types.push_back("string");
      if (types.empty()) return any_value();
    }
    if (types.size() == 1) return typed(types[0], s, path);
    const uint32_t r = rule(path);
    for (const auto& t : types) b_.add_alternative(r, {ref(typed(t, s, path))});
    return r;
  }

  uint32_t typed(const std::string& t, const json& s, const std::string& path) {
    if (t == "object") return object(s, path);
    if (t == "array") return array(s, path);
    if (t == "string") return string(s, path);
    if (t == "number") return number();
    if (t == "integer") return integer();
    if (t == "boolean") return boolean();
    return null();
  }

  uint32_t reference(const json& r, const std::string& path) {
    if (!r.is_string()) error(path, "'$ref' must be a string");
    const std::string target = r.get<std::string>();
    if (target.empty() || target[0] != '#')
      error(path, "only references inside the schema ('#...') are supported, not '" + target + "'");
    if (auto it = refs_.find(target); it != refs_.end()) {
      if (std::find(alias_chain_.begin(), alias_chain_.end(), target) != alias_chain_.end())
        error(path, "'$ref' '" + target + "' reaches itself without an object or array in between");
      return it->second;
    }
    json::json_pointer ptr;
    try {
      ptr = json::json_pointer(target.substr(1));
    } catch (const json::exception&) {
      error(path, "'$ref' '" + target + "' is not a JSON pointer");
    }
    if (!root_.contains(ptr)) error(path, "'$ref' '" + target + "' points at nothing");
    const uint32_t rr = rule(target);
    refs_[target] = rr;
    alias_chain_.push_back(target);
    const uint32_t body = compile(root_.at(ptr), target);
    alias_chain_.pop_back();
    b_.add_alternative(rr, {ref(body)});
    return rr;
  }

  // Compiles the schema of something inside an object or an array: a '{'
  // or '[' has been consumed, so a $ref seen again there is a true recursion.
  uint32_t nested(const json& s, const std::string& path) {
    std::vector<std::string> saved;
    std::swap(saved, alias_chain_);
    const uint32_t r = compile(s, path);
    std::swap(saved, alias_chain_);
    return r;
  }

  uint32_t object(const json& s, const std::string& path) {
    static const json empty = json::object();
    const json& props = s.contains("properties") ? s["properties"] : empty;
    if (!props.is_object()) error(path, "'properties' must be an object");
    std::set<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) error(path, "'required' must be an array of strings");
      for (const auto& n : *it) {
        if (!n.is_string()) error(path, "'required' must be an array of strings");
        if (!props.contains(n.get<std::string>()))
          error(path, "the required property '" + n.get<std::string>() + "' is not in 'properties'");
        required.insert(n.get<std::string>());
      }
    }
    std::optional<uint32_t> extra;  // the schema of additional properties, if any are generated
    if (auto it = s.find("additionalProperties"); it != s.end()) {
      if (!it->is_boolean() && !it->is_object()) error(path, "'additionalProperties' must be a boolean or a schema");
      if (!(it->is_boolean() && !it->get<bool>())) extra = nested(*it, path + "/additionalProperties");
    }
    if (props.size() > kMaxProperties)
      error(path, "more than " + std::to_string(kMaxProperties) + " 'properties' in one object are not supported");
    std::vector<Seq> members;
    std::vector<bool> optional;
    for (const auto& [name, sub] : props.items()) {
      const uint32_t v = nested(sub, path + "/properties/" + name);
      members.push_back(cat(cat(lit(json(name).dump()), colon()), {ref(v)}));
      optional.push_back(!required.count(name));
    }
    // first[i]: properties i.. with none written yet; next[i]: with some
    // written (each then starts with a comma). Optional ones may be skipped.
    const size_t n = members.size();
    std::vector<uint32_t> first(n + 1), next(n + 1);
    for (size_t i = 0; i <= n; ++i) {
      first[i] = rule(path + "{" + std::to_string(i));
      next[i] = rule(path + ",{" + std::to_string(i));
    }
    for (size_t i = 0; i < n; ++i) {
      b_.add_alternative(first[i], cat(members[i], {ref(next[i + 1])}));
      b_.add_alternative(next[i], cat(cat(comma(), members[i]), {ref(next[i + 1])}));
      if (optional[i]) {
        b_.add_alternative(first[i], {ref(first[i + 1])});
        b_.add_alternative(next[i], {ref(next[i + 1])});
      }
    }
    b_.add_alternative(first[n], {});
    b_.add_alternative(next[n], {});
    if (extra) {
      std::vector<std::string> names;
      for (const auto& [name, sub] : props.items()) names.push_back(name);
      const Seq member = cat(cat({b_.byte('"'), ref(key_excluding(names, path))}, colon()), {ref(*extra)});
      b_.add_alternative(first[n], cat(member, {ref(next[n])}));
      b_.add_alternative(next[n], cat(cat(comma(), member), {ref(next[n])}));
    }
    const uint32_t r = rule(path);
    b_.add_alternative(r, {b_.byte('{'), ref(first[0]), b_.byte('}')});
    return r;
  }

  // Any of `texts`, as a trie: values that share a prefix share its rules,
  // so the matcher follows one parse until they differ (a long enum of
  // similar strings would otherwise be as many parses at once).
  uint32_t literals(const std::vector<std::string>& texts, const std::string& path) {
    struct Node {
      std::map<uint8_t, size_t> next;
      bool ends = false;
    };
    std::vector<Node> trie(1);
    for (const std::string& t : texts) {
      size_t at = 0;
      for (unsigned char c : t) {
        auto it = trie[at].next.find(c);
        if (it == trie[at].next.end()) {
          trie.emplace_back();
          it = trie[at].next.emplace(c, trie.size() - 1).first;
        }
        at = it->second;
      }
      trie[at].ends = true;
    }
    std::vector<uint32_t> rules(trie.size());
    for (size_t i = 0; i < trie.size(); ++i) rules[i] = rule(path + "/enum");
    for (size_t i = 0; i < trie.size(); ++i) {
      for (const auto& [c, child] : trie[i].next) b_.add_alternative(rules[i], {b_.byte(c), ref(rules[child])});
      if (trie[i].ends) b_.add_alternative(rules[i], {});
    }
    return rules[0];
  }

  // The body and closing quote of a property name that is none of `names`
  // (an additional property must not repeat a declared one, which would
  // then be judged by the wrong schema). A trie over the names: while the
  // key follows one, it continues it or leaves it with a byte that starts
  // a different character, after which anything may follow; it may close
  // only where no name ends. Until it has left every name it is written
  // without escapes (an escape could spell a name's next character).
  uint32_t key_excluding(const std::vector<std::string>& names, const std::string& path) {
    struct Node {
      std::map<uint8_t, size_t> next;
      bool name_ends = false;
      int pending = 0;  // continuation bytes still due in the current character
    };
    std::vector<Node> trie(1);
    for (const std::string& n : names) {
      // A name with a quote, backslash or control character needs an
      // escape: an unescaped key never equals it.
      if (std::any_of(n.begin(), n.end(), [](char c) { return c == '"' || c == '\\' || uint8_t(c) < 0x20; })) continue;
      size_t at = 0;
      for (unsigned char c : n) {
        auto it = trie[at].next.find(c);
        if (it == trie[at].next.end()) {
          const int pending = trie[at].pending > 0 ? trie[at].pending - 1 : c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
          trie.push_back({{}, false, pending});
          it = trie[at].next.emplace(c, trie.size() - 1).first;
        }
        at = it->second;
      }
      trie[at].name_ends = true;
    }
    // Characters that start differently from every child: the first byte
    // of each well-formed UTF-8 sequence (RFC 3629), then its continuations.
    struct Start {
      uint8_t lo, hi;
      std::vector<std::pair<uint8_t, uint8_t>> rest;
    };
    static const std::vector<Start> starts = {
        {0x20, 0x7F, {}},          {0xC2, 0xDF, {{0x80, 0xBF}}},
        {0xE0, 0xE0, {{0xA0, 0xBF}, {0x80, 0xBF}}}, {0xE1, 0xEC, {{0x80, 0xBF}, {0x80, 0xBF}}},
        {0xED, 0xED, {{0x80, 0x9F}, {0x80, 0xBF}}}, {0xEE, 0xEF, {{0x80, 0xBF}, {0x80, 0xBF}}},
        {0xF0, 0xF0, {{0x90, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}},
        {0xF1, 0xF3, {{0x80, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}},
        {0xF4, 0xF4, {{0x80, 0x8F}, {0x80, 0xBF}, {0x80, 0xBF}}}};
    std::vector<uint32_t> rules(trie.size());
    for (size_t i = 0; i < trie.size(); ++i) rules[i] = rule(path + "/additional-key");
    for (size_t i = 0; i < trie.size(); ++i) {
      const Node& n = trie[i];
      for (const auto& [c, child] : n.next) b_.add_alternative(rules[i], {b_.byte(c), ref(rules[child])});
      if (n.pending > 0) continue;  // inside a name's character: only the name goes on
      if (!n.name_ends) b_.add_alternative(rules[i], lit("\""));
      for (const Start& st : starts) {
        std::bitset<256> first;
        for (unsigned c = st.lo; c <= st.hi; ++c)
          if (c != '"' && c != '\\' && !n.next.count(uint8_t(c))) first.set(c);
        if (first.none()) continue;
        Seq seq = {b_.bytes(first)};
        for (const auto& [lo, hi] : st.rest) seq.push_back(b_.byte_range(lo, hi));
        seq.push_back(GrammarBuilder::string_body(0, kUnbounded));
        b_.add_alternative(rules[i], seq);
      }
    }
    return rules[0];
  }

  uint32_t array(const json& s, const std::string& path) {
    if (s.contains("items") && s["items"].is_array())
      error(path, "'items' as an array (a tuple) is not supported");
    const uint32_t item = s.contains("items") ? nested(s["items"], path + "/items") : any_value();
    const uint64_t lo = count(s, "minItems", path).value_or(0);
    const std::optional<uint64_t> hi = count(s, "maxItems", path);
    if (hi && lo > *hi) error(path, "'minItems' is larger than 'maxItems'");
    if (lo > kMaxCountedItems) error(path, "'minItems' above " + std::to_string(kMaxCountedItems) + " is not supported");
    if (hi && *hi > kMaxCountedItems)
      error(path, "'maxItems' above " + std::to_string(kMaxCountedItems) + " is not supported");
    const uint32_t r = rule(path);
    if (lo == 0) b_.add_alternative(r, lit("[]"));
    if (hi && *hi == 0) return r;
    // tail[k]: the k-th element (1-based) and what may follow it.
    const uint64_t last = hi ? *hi : std::max<uint64_t>(lo, 1);  // unbounded: the last one repeats
    std::vector<uint32_t> tail(last + 1);
    for (uint64_t k = 1; k <= last; ++k) tail[k] = rule(path + "[" + std::to_string(k));
    for (uint64_t k = 1; k <= last; ++k) {
      const bool more_allowed = !hi || k < *hi;
      const uint32_t following = k < last ? tail[k + 1] : tail[k];
      if (more_allowed) b_.add_alternative(tail[k], cat(cat({ref(item)}, comma()), {ref(following)}));
      if (k >= lo) b_.add_alternative(tail[k], {ref(item)});
    }
    b_.add_alternative(r, {b_.byte('['), ref(tail[1]), b_.byte(']')});
    return r;
  }

  uint32_t string(const json& s, const std::string& path) {
    const uint64_t lo = count(s, "minLength", path).value_or(0);
    const std::optional<uint64_t> hi = count(s, "maxLength", path);
    if (hi && lo > *hi) error(path, "'minLength' is larger than 'maxLength'");
    if (lo >= kUnbounded || (hi && *hi >= kUnbounded)) error(path, "'minLength'/'maxLength' is too large");
    if (auto it = s.find("format"); it != s.end()) {
      if (!it->is_string()) error(path, "'format' must be a string");
      const std::string f = it->get<std::string>();
      std::optional<Seq> body;
      if (f == "date") body = date();
      else if (f == "time") body = time();
      else if (f == "date-time") body = cat(cat(date(), lit("T")), time());
      else if (f == "uuid") body = uuid();
      if (body) {
        const uint32_t r = rule(path);
        b_.add_alternative(r, cat(cat(lit("\""), *body), lit("\"")));
        return r;
      }
      // Any other format is an annotation (JSON Schema's default): a plain string.
    }
    const uint32_t r = rule(path);
    b_.add_alternative(r, {b_.byte('"'), GrammarBuilder::string_body(uint32_t(lo), hi ? uint32_t(*hi) : kUnbounded)});
    return r;
  }

  // RFC 3339 full-date, partial-time + time-offset (what JSON Schema's
  // date, time and date-time formats mean).
  Seq two_digit(std::initializer_list<std::pair<char, std::pair<char, char>>> alts, const char* name) {
    const uint32_t r = rule(name);
    for (const auto& [first, second] : alts) b_.add_alternative(r, {b_.byte(uint8_t(first)), b_.byte_range(uint8_t(second.first), uint8_t(second.second))});
    return {ref(r)};
  }
  Seq date() {
    Seq s = repeat(digit(), 4, 4);
    s = cat(s, lit("-"));
    s = cat(s, two_digit({{'0', {'1', '9'}}, {'1', {'0', '2'}}}, "month"));
    s = cat(s, lit("-"));
    return cat(s, two_digit({{'0', {'1', '9'}}, {'1', {'0', '9'}}, {'2', {'0', '9'}}, {'3', {'0', '1'}}}, "day"));
  }
  Seq time() {
    const Seq hour = two_digit({{'0', {'0', '9'}}, {'1', {'0', '9'}}, {'2', {'0', '3'}}}, "hour");
    const Seq minute = {b_.byte_range('0', '5'), digit()};
    Seq s = cat(cat(cat(cat(hour, lit(":")), minute), lit(":")), minute);
    const uint32_t frac = rule("time-fraction");
    b_.add_alternative(frac, {});
    b_.add_alternative(frac, cat(lit("."), repeat(digit(), 1, 9)));
    const uint32_t offset = rule("time-offset");
    b_.add_alternative(offset, lit("Z"));
    b_.add_alternative(offset, cat(cat(cat({b_.bytes(std::bitset<256>().set('+').set('-'))}, hour), lit(":")), minute));
    return cat(s, {ref(frac), ref(offset)});
  }
  Seq uuid() {
    std::bitset<256> hex;
    for (char c : std::string("0123456789abcdefABCDEF")) hex.set(uint8_t(c));
    const Element h = b_.bytes(hex);
    Seq s;
    for (uint32_t n : {8, 4, 4, 4, 12}) {
      if (!s.empty()) s = cat(s, lit("-"));
      s = cat(s, repeat(h, n, n));
    }
    return s;
  }
};

}  // namespace

Grammar json_schema_grammar(const nlohmann::ordered_json& schema) { return Compiler(schema).schema_grammar(); }

Grammar json_object_grammar() {
  const json none;
  return Compiler(none).object_grammar();
}

}  // namespace flashmoe
