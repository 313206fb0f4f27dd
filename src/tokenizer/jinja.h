// A small Jinja2 interpreter, enough for Hugging Face chat templates
// (Qwen3 / Qwen3.5 / ChatML style): {{ }}, {% if/elif/else %}, {% for %} with
// loop.*, else, and an inline `if` filter, {% set %} (incl. namespace
// attributes and block set), {% macro %}, break/continue, comments,
// whitespace control ({%- -%}, trim_blocks + lstrip_blocks as transformers
// configures its environment), the common filters, tests and Python string /
// dict methods. Values follow Python semantics where output depends on them
// (str() of None/True, truthiness, slicing, tojson like json.dumps).
// Anything outside the subset is a flashmoe::Error naming what is missing,
// never silently different output.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace flashmoe::jinja {

struct Value;
using Array = std::vector<Value>;
struct Object;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Function = std::function<Value(const std::vector<Value>& args, const Kwargs& kwargs)>;

struct Value {
  enum class Kind { Undefined, None, Bool, Int, Float, String, Array, Object, Function };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  // Shared so copies are cheap and namespace() objects mutate in place.
  std::shared_ptr<jinja::Array> arr;
  std::shared_ptr<jinja::Object> obj;
  std::shared_ptr<jinja::Function> fn;

  Value() = default;
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value array(jinja::Array v = {});
  static Value object();
  static Value function(jinja::Function f);
  static Value from_json(const nlohmann::ordered_json& j);
  nlohmann::ordered_json to_json() const;  // Error for functions/undefined

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float; }
  bool truthy() const;
  std::string str() const;   // Python str()
  std::string repr() const;  // Python repr()
  const char* type_name() const;
};

struct Object {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, like a Python dict
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
};

class Template {
 public:
  explicit Template(const std::string& source);  // throws Error on syntax errors
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  // `context` holds the template's variables (messages, add_generation_prompt, ...).
  std::string render(const Object& context) const;

  struct Node;

 private:
  std::vector<std::shared_ptr<Node>> root_;
};

}  // namespace flashmoe::jinja
