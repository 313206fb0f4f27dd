#include "tokenizer/jinja.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <map>

#include "core/error.h"

namespace flashmoe::jinja {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------- values

Value Value::none() { Value v; v.kind = Kind::None; return v; }
Value Value::boolean(bool x) { Value v; v.kind = Kind::Bool; v.b = x; return v; }
Value Value::integer(int64_t x) { Value v; v.kind = Kind::Int; v.i = x; return v; }
Value Value::number(double x) { Value v; v.kind = Kind::Float; v.f = x; return v; }
Value Value::string(std::string x) { Value v; v.kind = Kind::String; v.s = std::move(x); return v; }
Value Value::array(jinja::Array x) {
  Value v;
  v.kind = Kind::Array;
  v.arr = std::make_shared<jinja::Array>(std::move(x));
  return v;
}
Value Value::object() {
  Value v;
  v.kind = Kind::Object;
  v.obj = std::make_shared<jinja::Object>();
  return v;
}
Value Value::function(jinja::Function f) {
  Value v;
  v.kind = Kind::Function;
  v.fn = std::make_shared<jinja::Function>(std::move(f));
  return v;
}

Value Value::from_json(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null: return none();
    case ojson::value_t::boolean: return boolean(j.get<bool>());
    case ojson::value_t::number_integer:
    case ojson::value_t::number_unsigned: return integer(j.get<int64_t>());
    case ojson::value_t::number_float: return number(j.get<double>());
    case ojson::value_t::string: return string(j.get<std::string>());
    case ojson::value_t::array: {
      jinja::Array a;
      for (const auto& e : j) a.push_back(from_json(e));
      return array(std::move(a));
    }
    case ojson::value_t::object: {
      Value v = object();
      for (auto it = j.begin(); it != j.end(); ++it) v.obj->items.emplace_back(it.key(), from_json(it.value()));
      return v;
    }
    default: fail("chat template: unsupported JSON value");
  }
}

ojson Value::to_json() const {
  switch (kind) {
    case Kind::None: return nullptr;
    case Kind::Bool: return b;
    case Kind::Int: return i;
    case Kind::Float: return f;
    case Kind::String: return s;
    case Kind::Array: {
      ojson a = ojson::array();
      for (const auto& e : *arr) a.push_back(e.to_json());
      return a;
    }
    case Kind::Object: {
      ojson o = ojson::object();
      for (const auto& [k, v] : obj->items) o[k] = v.to_json();
      return o;
    }
    default: fail(std::string("chat template: cannot convert ") + type_name() + " to JSON");
  }
}

const char* Value::type_name() const {
  switch (kind) {
    case Kind::Undefined: return "undefined";
    case Kind::None: return "none";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "string";
    case Kind::Array: return "list";
    case Kind::Object: return "dict";
    case Kind::Function: return "function";
  }
  return "?";
}

bool Value::truthy() const {
  switch (kind) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return b;
    case Kind::Int: return i != 0;
    case Kind::Float: return f != 0;
    case Kind::String: return !s.empty();
    case Kind::Array: return !arr->empty();
    case Kind::Object: return !obj->items.empty();
    case Kind::Function: return true;
  }
  return false;
}

namespace {

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, d);
  std::string s(buf, p);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string py_quote(const std::string& s) {
  const char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') out += '\\', out += c;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else out += c;
  }
  return out + q;
}

// json.dumps(ensure_ascii=False): only quotes, backslashes and controls escaped.
void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  out += '"';
}

// Python json.dumps(x, ensure_ascii=False, indent=indent): separators are
// ", " / ": " without indent and "," / ": " with it.
void py_json(std::string& out, const Value& v, int indent, int depth) {
  auto newline = [&](int d) {
    out += '\n';
    out.append(size_t(indent * d), ' ');
  };
  switch (v.kind) {
    case Value::Kind::None: out += "null"; break;
    case Value::Kind::Bool: out += v.b ? "true" : "false"; break;
    case Value::Kind::Int: out += std::to_string(v.i); break;
    case Value::Kind::Float: {
      std::string r = float_repr(v.f);
      out += r == "nan" ? "NaN" : r == "inf" ? "Infinity" : r == "-inf" ? "-Infinity" : r;
      break;
    }
    case Value::Kind::String: json_string(out, v.s); break;
    case Value::Kind::Array: {
      if (v.arr->empty()) { out += "[]"; break; }
      out += '[';
      for (size_t k = 0; k < v.arr->size(); ++k) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        py_json(out, (*v.arr)[k], indent, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += ']';
      break;
    }
    case Value::Kind::Object: {
      if (v.obj->items.empty()) { out += "{}"; break; }
      out += '{';
      bool first = true;
      for (const auto& [k, e] : v.obj->items) {
        if (!first) out += indent >= 0 ? "," : ", ";
        first = false;
        if (indent >= 0) newline(depth + 1);
        json_string(out, k);
        out += ": ";
        py_json(out, e, indent, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += '}';
      break;
    }
    default: fail(std::string("chat template: tojson of ") + v.type_name());
  }
}

}  // namespace

std::string Value::str() const {
  switch (kind) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return b ? "True" : "False";
    case Kind::Int: return std::to_string(i);
    case Kind::Float: return float_repr(f);
    case Kind::String: return s;
    default: return repr();
  }
}

std::string Value::repr() const {
  switch (kind) {
    case Kind::String: return py_quote(s);
    case Kind::Array: {
      std::string out = "[";
      for (size_t k = 0; k < arr->size(); ++k) out += (k ? ", " : "") + (*arr)[k].repr();
      return out + "]";
    }
    case Kind::Object: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : obj->items) {
        out += (first ? "" : ", ") + py_quote(k) + ": " + v.repr();
        first = false;
      }
      return out + "}";
    }
    case Kind::Function: return "<function>";
    default: return str();
  }
}

const Value* Object::find(const std::string& key) const {
  for (const auto& kv : items)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

void Object::set(const std::string& key, Value v) {
  for (auto& kv : items)
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

// ---------------------------------------------------------------- lexing

namespace {

[[noreturn]] void syntax(const std::string& msg) { fail("chat template syntax error: " + msg); }

struct Chunk {
  enum Kind { Text, Expr, Stmt } kind;
  std::string body;
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Splits the source into text / {{ expr }} / {% stmt %} chunks, applying
// whitespace control: "-" markers strip adjacent whitespace; trim_blocks
// drops the newline after a block tag; lstrip_blocks drops the indentation
// before one ("+" disables it), as transformers' Jinja environment does.
std::vector<Chunk> lex(const std::string& src) {
  std::vector<Chunk> out;
  size_t pos = 0;
  bool lstrip_next = false, trim_newline_next = false;
  auto add_text = [&](std::string t) {
    if (lstrip_next) {
      size_t k = 0;
      while (k < t.size() && is_space(t[k])) ++k;
      t.erase(0, k);
    } else if (trim_newline_next) {
      if (t.rfind("\r\n", 0) == 0) t.erase(0, 2);
      else if (!t.empty() && t[0] == '\n') t.erase(0, 1);
    }
    lstrip_next = trim_newline_next = false;
    if (!t.empty()) out.push_back({Chunk::Text, std::move(t)});
  };
  while (pos < src.size()) {
    size_t open = src.find('{', pos);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' &&
           src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open == std::string::npos || open + 1 >= src.size()) {
      add_text(src.substr(pos));
      break;
    }
    std::string text = src.substr(pos, open - pos);
    const char type = src[open + 1];
    size_t inner = open + 2;
    const bool strip_before = inner < src.size() && src[inner] == '-';
    const bool plus = inner < src.size() && src[inner] == '+';
    if (strip_before || plus) ++inner;
    if (strip_before) {
      while (!text.empty() && is_space(text.back())) text.pop_back();
    } else if (type != '{' && !plus) {
      // lstrip_blocks: remove spaces/tabs between the line start and the tag.
      size_t k = text.size();
      while (k > 0 && (text[k - 1] == ' ' || text[k - 1] == '\t')) --k;
      // Only when the tag is the first non-blank thing on its line.
      bool strip;
      if (k > 0) {
        strip = text[k - 1] == '\n';
      } else {
        const size_t before = open - text.size();
        strip = before == 0 || src[before - 1] == '\n';
      }
      if (strip) text.resize(k);
    }
    add_text(std::move(text));
    const char* close = type == '{' ? "}}" : type == '%' ? "%}" : "#}";
    // Find the closer, skipping string literals inside expressions.
    size_t k = inner;
    char quote = 0;
    size_t end = std::string::npos;
    for (; k + 1 < src.size(); ++k) {
      const char c = src[k];
      if (type != '#' && quote) {
        if (c == '\\') ++k;
        else if (c == quote) quote = 0;
        continue;
      }
      if (type != '#' && (c == '\'' || c == '"')) {
        quote = c;
        continue;
      }
      if (c == close[0] && src[k + 1] == close[1]) {
        end = k;
        break;
      }
    }
    if (end == std::string::npos) syntax(std::string("unclosed '{") + type + "' tag");
    const bool strip_after = end > inner && src[end - 1] == '-';
    std::string body = src.substr(inner, end - inner - (strip_after ? 1 : 0));
    if (type == '{') out.push_back({Chunk::Expr, std::move(body)});
    else if (type == '%') out.push_back({Chunk::Stmt, std::move(body)});
    pos = end + 2;
    lstrip_next = strip_after;
    trim_newline_next = !strip_after && type != '{';
  }
  return out;
}

// Expression tokens.
struct Tok {
  enum Kind { Name, Str, Int, Float, Op, End } kind;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

std::vector<Tok> tokenize(const std::string& s) {
  std::vector<Tok> out;
  size_t k = 0;
  while (k < s.size()) {
    const char c = s[k];
    if (is_space(c)) { ++k; continue; }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = k;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Tok::Name, s.substr(k, e - k)});
      k = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = k;
      bool is_float = false;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        is_float = true;
        ++e;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      }
      std::string num = s.substr(k, e - k);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Tok t{is_float ? Tok::Float : Tok::Int, num};
      try {
        if (is_float) t.f = std::stod(num);
        else t.i = std::stoll(num);
      } catch (const std::out_of_range&) {  // std::stoll/stod throw it for 2**63 and up
        syntax("number literal '" + num + "' is out of range");
      }
      out.push_back(t);
      k = e;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t e = k + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] == '\\' && e + 1 < s.size()) {
          const char n = s[++e];
          switch (n) {
            case 'n': v += '\n'; break;
            case 't': v += '\t'; break;
            case 'r': v += '\r'; break;
            case '\\': v += '\\'; break;
            case '\'': v += '\''; break;
            case '"': v += '"'; break;
            default: v += '\\'; v += n;
          }
        } else {
          v += s[e];
        }
      }
      if (e >= s.size()) syntax("unterminated string literal");
      out.push_back({Tok::Str, v});
      k = e + 1;
    } else {
      static const char* two[] = {"//", "**", "==", "!=", "<=", ">="};
      std::string op(1, c);
      for (const char* t : two)
        if (s.compare(k, 2, t) == 0) op = t;
      if (op.size() == 1 && std::string_view("+-*/%~<>=()[]{}.,:|!").find(c) == std::string_view::npos)
        syntax(std::string("unexpected character '") + c + "'");
      out.push_back({Tok::Op, op});
      k += op.size();
    }
  }
  out.push_back({Tok::End, ""});
  return out;
}

// ---------------------------------------------------------------- AST

struct Expr;
using ExprP = std::shared_ptr<Expr>;
struct Expr {
  enum Kind { Literal, Name, Attr, Index, Slice, Call, Filter, Test, Neg, Binary, And, Or, Not, Cond, List, Dict };
  Kind kind;
  Value lit;
  std::string name;  // variable / attribute / filter / test name, or operator
  std::vector<ExprP> args;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  bool negate = false;
  int depth = 1;  // of the tree built through mk (operator chains included)
};

// Nesting limits: the parser, the evaluator and the AST's destructors are
// recursive, so a hostile template ("((((...", "1+1+1+...", a macro calling
// itself) must fail with an Error before it can overflow the stack.
constexpr int kMaxExprDepth = 256;    // AST depth of one expression
constexpr int kMaxParseNesting = 96;  // parenthesis / unary / list nesting
constexpr int kMaxBlockNesting = 128; // {% if/for/macro/set %} blocks
constexpr int kMaxEvalDepth = 2048;   // evaluator recursion, macros included
constexpr int kMaxMacroDepth = 64;    // nested macro calls

struct DepthGuard {
  DepthGuard(int& d, int limit, const char* what, void (*err)(const std::string&)) : d_(d) {
    if (++d_ > limit) {
      --d_;
      err(std::string(what) + " nested too deeply (limit " + std::to_string(limit) + ")");
    }
  }
  ~DepthGuard() { --d_; }
  int& d_;
};

[[noreturn]] void syntax(const std::string& msg);

ExprP mk(Expr::Kind k, std::string name = {}, std::vector<ExprP> args = {}) {
  auto e = std::make_shared<Expr>();
  e->kind = k;
  e->name = std::move(name);
  e->args = std::move(args);
  for (const auto& a : e->args)
    if (a) e->depth = std::max(e->depth, a->depth + 1);
  if (e->depth > kMaxExprDepth)
    syntax("expression nested too deeply (limit " + std::to_string(kMaxExprDepth) + ")");
  return e;
}

class ExprParser {
 public:
  explicit ExprParser(const std::string& src) : toks_(tokenize(src)), src_(src) {}

  ExprP parse_expression() { return parse_cond(); }
  bool at_end() const { return toks_[p_].kind == Tok::End; }
  bool peek_name(const char* n) const { return toks_[p_].kind == Tok::Name && toks_[p_].text == n; }
  bool peek_op(const char* o) const { return toks_[p_].kind == Tok::Op && toks_[p_].text == o; }
  bool accept_name(const char* n) { return peek_name(n) ? (++p_, true) : false; }
  bool accept_op(const char* o) { return peek_op(o) ? (++p_, true) : false; }
  void expect_op(const char* o) {
    if (!accept_op(o)) error(std::string("expected '") + o + "'");
  }
  std::string expect_name() {
    if (toks_[p_].kind != Tok::Name) error("expected a name");
    return toks_[p_++].text;
  }
  void expect_end() {
    if (!at_end()) error("unexpected '" + toks_[p_].text + "'");
  }
  [[noreturn]] void error(const std::string& msg) const { syntax(msg + " in '" + src_ + "'"); }

  // Bodies without the ternary (for the inline `if` of a for tag).
  ExprP parse_or_public() { return parse_or(); }

 private:
  ExprP parse_cond() {
    DepthGuard g(nest_, kMaxParseNesting, "expression", err_syntax);
    ExprP e = parse_or();
    if (accept_name("if")) {
      ExprP cond = parse_or();
      ExprP other = accept_name("else") ? parse_cond() : mk(Expr::Literal);
      return mk(Expr::Cond, {}, {cond, e, other});
    }
    return e;
  }
  ExprP parse_or() {
    ExprP e = parse_and();
    while (accept_name("or")) e = mk(Expr::Or, {}, {e, parse_and()});
    return e;
  }
  ExprP parse_and() {
    ExprP e = parse_not();
    while (accept_name("and")) e = mk(Expr::And, {}, {e, parse_not()});
    return e;
  }
  ExprP parse_not() {
    DepthGuard g(nest_, kMaxParseNesting, "expression", err_syntax);
    if (accept_name("not")) return mk(Expr::Not, {}, {parse_not()});
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP e = parse_math1();
    for (;;) {
      static const char* ops[] = {"==", "!=", "<", ">", "<=", ">="};
      bool matched = false;
      for (const char* o : ops)
        if (accept_op(o)) {
          e = mk(Expr::Binary, o, {e, parse_math1()});
          matched = true;
          break;
        }
      if (matched) continue;
      if (accept_name("in")) {
        e = mk(Expr::Binary, "in", {e, parse_math1()});
      } else if (peek_name("not") && toks_[p_ + 1].kind == Tok::Name && toks_[p_ + 1].text == "in") {
        p_ += 2;
        e = mk(Expr::Not, {}, {mk(Expr::Binary, "in", {e, parse_math1()})});
      } else {
        return e;
      }
    }
  }
  ExprP parse_math1() {
    ExprP e = parse_concat();
    for (;;) {
      if (accept_op("+")) e = mk(Expr::Binary, "+", {e, parse_concat()});
      else if (accept_op("-")) e = mk(Expr::Binary, "-", {e, parse_concat()});
      else return e;
    }
  }
  ExprP parse_concat() {
    ExprP e = parse_math2();
    while (accept_op("~")) e = mk(Expr::Binary, "~", {e, parse_math2()});
    return e;
  }
  ExprP parse_math2() {
    ExprP e = parse_pow();
    for (;;) {
      static const char* ops[] = {"*", "/", "//", "%"};
      bool matched = false;
      for (const char* o : ops)
        if (accept_op(o)) {
          e = mk(Expr::Binary, o, {e, parse_pow()});
          matched = true;
          break;
        }
      if (!matched) return e;
    }
  }
  ExprP parse_pow() {
    ExprP e = parse_unary();
    while (accept_op("**")) e = mk(Expr::Binary, "**", {e, parse_unary()});
    return e;
  }
  ExprP parse_unary() {
    DepthGuard g(nest_, kMaxParseNesting, "expression", err_syntax);
    if (accept_op("-")) return parse_filters(mk(Expr::Neg, {}, {parse_unary()}));
    if (accept_op("+")) return parse_unary();
    return parse_filters(parse_postfix(parse_primary()));
  }
  // `x | f(args)` and `x is [not] test(args)` chains.
  ExprP parse_filters(ExprP e) {
    for (;;) {
      if (accept_op("|")) {
        ExprP f = mk(Expr::Filter, expect_name(), {e});
        if (accept_op("(")) parse_args(*f);
        e = f;
      } else if (accept_name("is")) {
        ExprP t = mk(Expr::Test);
        t->negate = accept_name("not");
        // `none`, `true`, `false` are names here.
        t->name = expect_name();
        t->args.push_back(e);
        if (accept_op("(")) {
          parse_args(*t);
        } else if (toks_[p_].kind == Tok::Str || toks_[p_].kind == Tok::Int || toks_[p_].kind == Tok::Float) {
          t->args.push_back(parse_primary());
        }
        e = t;
      } else {
        return e;
      }
    }
  }
  // Arguments after '(' up to ')': positional then name=value.
  void parse_args(Expr& call) {
    while (!accept_op(")")) {
      if (toks_[p_].kind == Tok::Name && toks_[p_ + 1].kind == Tok::Op && toks_[p_ + 1].text == "=") {
        std::string key = toks_[p_].text;
        p_ += 2;
        call.kwargs.emplace_back(key, parse_cond());
      } else {
        call.args.push_back(parse_cond());
      }
      if (!peek_op(")")) expect_op(",");
    }
  }
  ExprP parse_postfix(ExprP e) {
    for (;;) {
      if (accept_op(".")) {
        e = mk(Expr::Attr, expect_name(), {e});
      } else if (accept_op("[")) {
        ExprP start, stop, step;
        bool slice = false;
        if (!peek_op(":")) start = parse_cond();
        if (accept_op(":")) {
          slice = true;
          if (!peek_op("]") && !peek_op(":")) stop = parse_cond();
          if (accept_op(":") && !peek_op("]")) step = parse_cond();
        }
        expect_op("]");
        e = slice ? mk(Expr::Slice, {}, {e, start, stop, step}) : mk(Expr::Index, {}, {e, start});
      } else if (accept_op("(")) {
        ExprP c = mk(Expr::Call, {}, {e});
        parse_args(*c);
        e = c;
      } else {
        return e;
      }
    }
  }
  ExprP parse_primary() {
    const Tok& t = toks_[p_];
    switch (t.kind) {
      case Tok::Str: {
        ++p_;
        std::string s = t.text;
        while (toks_[p_].kind == Tok::Str) s += toks_[p_++].text;  // adjacent literals concatenate
        ExprP e = mk(Expr::Literal);
        e->lit = Value::string(s);
        return e;
      }
      case Tok::Int: {
        ++p_;
        ExprP e = mk(Expr::Literal);
        e->lit = Value::integer(t.i);
        return e;
      }
      case Tok::Float: {
        ++p_;
        ExprP e = mk(Expr::Literal);
        e->lit = Value::number(t.f);
        return e;
      }
      case Tok::Name: {
        ++p_;
        ExprP e = mk(Expr::Literal);
        if (t.text == "true" || t.text == "True") e->lit = Value::boolean(true);
        else if (t.text == "false" || t.text == "False") e->lit = Value::boolean(false);
        else if (t.text == "none" || t.text == "None") e->lit = Value::none();
        else e = mk(Expr::Name, t.text);
        return e;
      }
      case Tok::Op:
        if (accept_op("(")) {
          ExprP e = parse_cond();
          if (accept_op(",")) {  // tuple: treat as list
            ExprP l = mk(Expr::List, {}, {e});
            while (!peek_op(")")) {
              l->args.push_back(parse_cond());
              if (!peek_op(")")) expect_op(",");
            }
            e = l;
          }
          expect_op(")");
          return e;
        }
        if (accept_op("[")) {
          ExprP l = mk(Expr::List);
          while (!accept_op("]")) {
            l->args.push_back(parse_cond());
            if (!peek_op("]")) expect_op(",");
          }
          return l;
        }
        if (accept_op("{")) {
          ExprP d = mk(Expr::Dict);
          while (!accept_op("}")) {
            d->args.push_back(parse_cond());
            expect_op(":");
            d->args.push_back(parse_cond());
            if (!peek_op("}")) expect_op(",");
          }
          return d;
        }
        [[fallthrough]];
      default: error("unexpected '" + t.text + "'");
    }
  }

  std::vector<Tok> toks_;
  size_t p_ = 0;
  int nest_ = 0;
  static void err_syntax(const std::string& m) { syntax(m); }
  std::string src_;
};

}  // namespace

// ---------------------------------------------------------------- statements

struct Template::Node {
  enum Kind { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue } kind;
  std::string text;
  ExprP expr;                                                    // output / set value / for iterable
  std::vector<std::pair<ExprP, std::vector<std::shared_ptr<Node>>>> branches;  // if: (cond|null, body)
  std::vector<std::string> vars;                                 // for targets / macro params
  std::vector<ExprP> defaults;                                   // macro param defaults (may be null)
  ExprP filter;                                                  // for ... if filter
  std::vector<std::shared_ptr<Node>> body, else_body;
  std::string target, attr;                                      // set target[.attr]
};

namespace {

using Node = Template::Node;
using NodeP = std::shared_ptr<Node>;

class StmtParser {
 public:
  explicit StmtParser(std::vector<Chunk> chunks) : chunks_(std::move(chunks)) {}

  std::vector<NodeP> parse_all() {
    std::string end;
    auto nodes = parse_block({}, end);
    return nodes;
  }

 private:
  static std::string first_word(const std::string& s) {
    size_t b = 0;
    while (b < s.size() && is_space(s[b])) ++b;
    size_t e = b;
    while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
    return s.substr(b, e - b);
  }

  // Parses nodes until one of `enders` (returned in `ended`, its chunk consumed).
  std::vector<NodeP> parse_block(const std::vector<std::string>& enders, std::string& ended) {
    std::vector<NodeP> nodes;
    while (i_ < chunks_.size()) {
      const Chunk& c = chunks_[i_];
      if (c.kind == Chunk::Text) {
        auto n = std::make_shared<Node>();
        n->kind = Node::Text;
        n->text = c.body;
        nodes.push_back(n);
        ++i_;
        continue;
      }
      if (c.kind == Chunk::Expr) {
        ExprParser p(c.body);
        auto n = std::make_shared<Node>();
        n->kind = Node::Output;
        n->expr = p.parse_expression();
        p.expect_end();
        nodes.push_back(n);
        ++i_;
        continue;
      }
      const std::string word = first_word(c.body);
      if (std::find(enders.begin(), enders.end(), word) != enders.end()) {
        ended = word;
        return nodes;  // the caller consumes the ender chunk
      }
      ++i_;
      ExprParser p(c.body);
      p.expect_name();
      if (word == "if") {
        nodes.push_back(parse_if(p));
      } else if (word == "for") {
        nodes.push_back(parse_for(p));
      } else if (word == "set") {
        nodes.push_back(parse_set(p));
      } else if (word == "macro") {
        nodes.push_back(parse_macro(p));
      } else if (word == "break" || word == "continue") {
        p.expect_end();
        auto n = std::make_shared<Node>();
        n->kind = word == "break" ? Node::Break : Node::Continue;
        nodes.push_back(n);
      } else if (word == "generation" || word == "endgeneration") {
        p.expect_end();  // transformers' assistant-mask markers: no output
      } else {
        syntax("unsupported or unexpected tag '{% " + word + " %}'");
      }
    }
    if (!enders.empty()) syntax("missing '{% " + enders.back() + " %}'");
    return nodes;
  }

  std::vector<NodeP> parse_body(const std::vector<std::string>& enders, std::string& ended) {
    DepthGuard g(nest_, kMaxBlockNesting, "block", [](const std::string& m) { syntax(m); });
    auto nodes = parse_block(enders, ended);
    return nodes;
  }

  NodeP parse_if(ExprParser& p) {
    auto n = std::make_shared<Node>();
    n->kind = Node::If;
    ExprP cond = p.parse_expression();
    p.expect_end();
    for (;;) {
      std::string ended;
      auto body = parse_body({"elif", "else", "endif"}, ended);
      n->branches.emplace_back(cond, std::move(body));
      ExprParser q(chunks_[i_].body);
      ++i_;
      q.expect_name();
      if (ended == "endif") {
        q.expect_end();
        return n;
      }
      if (ended == "else") {
        q.expect_end();
        std::string e2;
        auto else_body = parse_body({"endif"}, e2);
        ++i_;
        n->branches.emplace_back(nullptr, std::move(else_body));
        return n;
      }
      cond = q.parse_expression();  // elif
      q.expect_end();
    }
  }

  NodeP parse_for(ExprParser& p) {
    auto n = std::make_shared<Node>();
    n->kind = Node::For;
    n->vars.push_back(p.expect_name());
    while (p.accept_op(",")) n->vars.push_back(p.expect_name());
    if (!p.accept_name("in")) p.error("expected 'in'");
    n->expr = p.parse_or_public();
    if (p.accept_name("if")) n->filter = p.parse_or_public();
    if (p.accept_name("recursive")) p.error("recursive loops are not supported");
    p.expect_end();
    std::string ended;
    n->body = parse_body({"else", "endfor"}, ended);
    ++i_;
    if (ended == "else") {
      std::string e2;
      n->else_body = parse_body({"endfor"}, e2);
      ++i_;
    }
    return n;
  }

  NodeP parse_set(ExprParser& p) {
    auto n = std::make_shared<Node>();
    n->target = p.expect_name();
    if (p.accept_op(".")) n->attr = p.expect_name();
    if (p.peek_op(",")) p.error("tuple assignment is not supported");
    if (p.accept_op("=")) {
      n->kind = Node::Set;
      n->expr = p.parse_expression();
      p.expect_end();
    } else {
      p.expect_end();
      n->kind = Node::SetBlock;
      std::string ended;
      n->body = parse_body({"endset"}, ended);
      ++i_;
    }
    return n;
  }

  NodeP parse_macro(ExprParser& p) {
    auto n = std::make_shared<Node>();
    n->kind = Node::Macro;
    n->target = p.expect_name();
    p.expect_op("(");
    while (!p.accept_op(")")) {
      n->vars.push_back(p.expect_name());
      n->defaults.push_back(p.accept_op("=") ? p.parse_expression() : nullptr);
      if (!p.peek_op(")")) p.expect_op(",");
    }
    p.expect_end();
    std::string ended;
    n->body = parse_body({"endmacro"}, ended);
    ++i_;
    return n;
  }

  std::vector<Chunk> chunks_;
  size_t i_ = 0;
  int nest_ = 0;
};

}  // namespace

Template::Template(const std::string& source) { root_ = StmtParser(lex(source)).parse_all(); }
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

// ---------------------------------------------------------------- evaluation

namespace {

[[noreturn]] void runtime(const std::string& msg) { fail("chat template error: " + msg); }

enum class Flow { Normal, Break, Continue };

std::string py_strip(const std::string& s, const Value* chars, bool left, bool right) {
  const std::string set = chars && chars->is_string() ? chars->s : std::string(" \t\n\r\f\v");
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && set.find(s[b]) != std::string::npos) ++b;
  if (right)
    while (e > b && set.find(s[e - 1]) != std::string::npos) --e;
  return s.substr(b, e - b);
}

Value py_split(const std::string& s, const Value* sep, int64_t maxsplit) {
  Array parts;
  if (!sep || sep->is_none()) {
    size_t k = 0;
    while (k < s.size()) {
      while (k < s.size() && is_space(s[k])) ++k;
      if (k >= s.size()) break;
      if (maxsplit >= 0 && int64_t(parts.size()) == maxsplit) {
        std::string rest = s.substr(k);
        while (!rest.empty() && is_space(rest.back())) rest.pop_back();
        parts.push_back(Value::string(rest));
        break;
      }
      size_t e = k;
      while (e < s.size() && !is_space(s[e])) ++e;
      parts.push_back(Value::string(s.substr(k, e - k)));
      k = e;
    }
    return Value::array(std::move(parts));
  }
  if (!sep->is_string() || sep->s.empty()) runtime("split() separator must be a non-empty string");
  size_t k = 0;
  for (;;) {
    const size_t e = s.find(sep->s, k);
    if (e == std::string::npos || (maxsplit >= 0 && int64_t(parts.size()) == maxsplit)) {
      parts.push_back(Value::string(s.substr(k)));
      break;
    }
    parts.push_back(Value::string(s.substr(k, e - k)));
    k = e + sep->s.size();
  }
  return Value::array(std::move(parts));
}

std::string py_replace(std::string s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  size_t k = 0;
  int64_t n = 0;
  while ((count < 0 || n < count) && (k = s.find(from, k)) != std::string::npos) {
    s.replace(k, from.size(), to);
    k += to.size();
    ++n;
  }
  return s;
}

bool values_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::Int && b.kind == Value::Kind::Int) return a.i == b.i;
    return (a.kind == Value::Kind::Int ? double(a.i) : a.f) == (b.kind == Value::Kind::Int ? double(b.i) : b.f);
  }
  if ((a.kind == Value::Kind::Bool && b.is_number()) || (b.kind == Value::Kind::Bool && a.is_number())) {
    const double x = a.kind == Value::Kind::Bool ? a.b : a.kind == Value::Kind::Int ? double(a.i) : a.f;
    const double y = b.kind == Value::Kind::Bool ? b.b : b.kind == Value::Kind::Int ? double(b.i) : b.f;
    return x == y;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::Bool: return a.b == b.b;
    case Value::Kind::String: return a.s == b.s;
    case Value::Kind::Array:
      if (a.arr->size() != b.arr->size()) return false;
      for (size_t k = 0; k < a.arr->size(); ++k)
        if (!values_equal((*a.arr)[k], (*b.arr)[k])) return false;
      return true;
    case Value::Kind::Object:
      if (a.obj->items.size() != b.obj->items.size()) return false;
      for (const auto& [k, v] : a.obj->items) {
        const Value* o = b.obj->find(k);
        if (!o || !values_equal(v, *o)) return false;
      }
      return true;
    default: return a.fn == b.fn;
  }
}

double as_double(const Value& v, const char* what) {
  if (v.kind == Value::Kind::Int) return double(v.i);
  if (v.kind == Value::Kind::Float) return v.f;
  if (v.kind == Value::Kind::Bool) return v.b;
  runtime(std::string("cannot use ") + v.type_name() + " in " + what);
}

int compare_values(const Value& a, const Value& b) {
  if (a.is_string() && b.is_string()) return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
  const double x = as_double(a, "a comparison"), y = as_double(b, "a comparison");
  return x < y ? -1 : x > y ? 1 : 0;
}

// Items of an iterable for `for`, `in`, filters.
Array iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Array: return *v.arr;
    case Value::Kind::Object: {
      Array keys;
      for (const auto& kv : v.obj->items) keys.push_back(Value::string(kv.first));
      return keys;
    }
    case Value::Kind::String: {
      Array chars;
      for (size_t k = 0; k < v.s.size();) {
        size_t e = k + 1;
        while (e < v.s.size() && (static_cast<unsigned char>(v.s[e]) & 0xC0) == 0x80) ++e;
        chars.push_back(Value::string(v.s.substr(k, e - k)));
        k = e;
      }
      return chars;
    }
    case Value::Kind::Undefined: return {};
    default: runtime(std::string("'") + v.type_name() + "' object is not iterable");
  }
}

Value items_of(const Value& v) {
  if (v.kind != Value::Kind::Object) runtime(std::string("items() of ") + v.type_name());
  Array out;
  for (const auto& [k, e] : v.obj->items) out.push_back(Value::array({Value::string(k), e}));
  return Value::array(std::move(out));
}

class Scope {
 public:
  explicit Scope(const Object& globals) { frames_.push_back(globals); }
  Value lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it)
      if (const Value* v = it->find(name)) return *v;
    return {};
  }
  void set(const std::string& name, Value v) { frames_.back().set(name, std::move(v)); }
  void push() { frames_.emplace_back(); }
  void pop() { frames_.pop_back(); }
  const Object& globals() const { return frames_.front(); }

 private:
  std::vector<Object> frames_;
};

class Renderer {
 public:
  explicit Renderer(const Object& ctx) : scope_(ctx) {}
  int macro_depth_ = 0, eval_depth_ = 0;

  Flow exec(const std::vector<NodeP>& nodes, std::string& out) {
    for (const auto& n : nodes) {
      const Flow f = exec(*n, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::Text: out += n.text; break;
      case Node::Output: out += eval(*n.expr).str(); break;
      case Node::If:
        for (const auto& [cond, body] : n.branches)
          if (!cond || eval(*cond).truthy()) return exec(body, out);
        break;
      case Node::For: return exec_for(n, out);
      case Node::Set: assign(n, eval(*n.expr)); break;
      case Node::SetBlock: {
        std::string captured;
        exec(n.body, captured);
        assign(n, Value::string(captured));
        break;
      }
      case Node::Macro: define_macro(n); break;
      case Node::Break: return Flow::Break;
      case Node::Continue: return Flow::Continue;
    }
    return Flow::Normal;
  }

 private:
  void assign(const Node& n, Value v) {
    if (n.attr.empty()) {
      scope_.set(n.target, std::move(v));
      return;
    }
    Value ns = scope_.lookup(n.target);
    if (ns.kind != Value::Kind::Object) runtime("cannot set attribute of non-namespace '" + n.target + "'");
    ns.obj->set(n.attr, std::move(v));
  }

  Flow exec_for(const Node& n, std::string& out) {
    const Value seq = eval(*n.expr);
    Array items = iterate(seq);
    if (n.filter) {
      Array kept;
      for (auto& it : items) {
        scope_.push();
        bind_loop_vars(n, it);
        if (eval(*n.filter).truthy()) kept.push_back(it);
        scope_.pop();
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(n.else_body, out);
    const int64_t len = int64_t(items.size());
    for (int64_t k = 0; k < len; ++k) {
      scope_.push();
      Value loop = Value::object();
      auto& o = *loop.obj;
      o.set("index0", Value::integer(k));
      o.set("index", Value::integer(k + 1));
      o.set("revindex0", Value::integer(len - k - 1));
      o.set("revindex", Value::integer(len - k));
      o.set("first", Value::boolean(k == 0));
      o.set("last", Value::boolean(k == len - 1));
      o.set("length", Value::integer(len));
      o.set("previtem", k > 0 ? items[k - 1] : Value());
      o.set("nextitem", k + 1 < len ? items[k + 1] : Value());
      scope_.set("loop", loop);
      bind_loop_vars(n, items[k]);
      const Flow f = exec(n.body, out);
      scope_.pop();
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  void bind_loop_vars(const Node& n, const Value& item) {
    if (n.vars.size() == 1) {
      scope_.set(n.vars[0], item);
      return;
    }
    if (item.kind != Value::Kind::Array || item.arr->size() != n.vars.size())
      runtime("cannot unpack loop item into " + std::to_string(n.vars.size()) + " names");
    for (size_t k = 0; k < n.vars.size(); ++k) scope_.set(n.vars[k], (*item.arr)[k]);
  }

  void define_macro(const Node& n) {
    const Node* node = &n;
    scope_.set(n.target, Value::function([this, node](const std::vector<Value>& args, const Kwargs& kwargs) {
      if (args.size() > node->vars.size()) runtime("macro '" + node->target + "' got too many arguments");
      DepthGuard g(macro_depth_, kMaxMacroDepth, "macro call", [](const std::string& m) { runtime(m); });
      scope_.push();
      for (size_t k = 0; k < node->vars.size(); ++k) {
        Value v;
        if (k < args.size()) v = args[k];
        else if (node->defaults[k]) v = eval(*node->defaults[k]);
        for (const auto& [key, kv] : kwargs)
          if (key == node->vars[k]) v = kv;
        scope_.set(node->vars[k], v);
      }
      std::string out;
      exec(node->body, out);
      scope_.pop();
      return Value::string(out);
    }));
  }

  Value eval(const Expr& e) {
    DepthGuard g(eval_depth_, kMaxEvalDepth, "expression evaluation", [](const std::string& m) { runtime(m); });
    switch (e.kind) {
      case Expr::Literal: return e.lit;
      case Expr::Name: return lookup_name(e.name);
      case Expr::Attr: return get_attr(eval(*e.args[0]), e.name);
      case Expr::Index: return get_index(eval(*e.args[0]), eval(*e.args[1]));
      case Expr::Slice: return slice(e);
      case Expr::Call: return call(e);
      case Expr::Filter: return filter(e);
      case Expr::Test: return Value::boolean(test(e) != e.negate);
      case Expr::Neg: {
        const Value v = eval(*e.args[0]);
        if (v.kind == Value::Kind::Int) return Value::integer(-v.i);
        return Value::number(-as_double(v, "negation"));
      }
      case Expr::Binary: return binary(e.name, eval(*e.args[0]), eval(*e.args[1]));
      case Expr::And: {
        Value a = eval(*e.args[0]);
        return a.truthy() ? eval(*e.args[1]) : a;
      }
      case Expr::Or: {
        Value a = eval(*e.args[0]);
        return a.truthy() ? a : eval(*e.args[1]);
      }
      case Expr::Not: return Value::boolean(!eval(*e.args[0]).truthy());
      case Expr::Cond: return eval(*e.args[0]).truthy() ? eval(*e.args[1]) : eval(*e.args[2]);
      case Expr::List: {
        Array a;
        for (const auto& x : e.args) a.push_back(eval(*x));
        return Value::array(std::move(a));
      }
      case Expr::Dict: {
        Value d = Value::object();
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) d.obj->set(eval(*e.args[k]).str(), eval(*e.args[k + 1]));
        return d;
      }
    }
    return {};
  }

  Value lookup_name(const std::string& name) {
    Value v = scope_.lookup(name);
    if (!v.is_undefined()) return v;
    if (name == "namespace" || name == "range" || name == "raise_exception" || name == "strftime_now" ||
        name == "dict")
      return Value::function([this, name](const std::vector<Value>& a, const Kwargs& kw) { return builtin(name, a, kw); });
    return v;
  }

  Value builtin(const std::string& name, const std::vector<Value>& a, const Kwargs& kw) {
    if (name == "namespace" || name == "dict") {
      Value ns = Value::object();
      for (const auto& arg : a)
        if (arg.kind == Value::Kind::Object)
          for (const auto& [k, v] : arg.obj->items) ns.obj->set(k, v);
      for (const auto& [k, v] : kw) ns.obj->set(k, v);
      return ns;
    }
    if (name == "range") {
      int64_t start = 0, stop = 0, step = 1;
      auto num = [&](size_t k) {
        if (a[k].kind != Value::Kind::Int) runtime("range() needs integers");
        return a[k].i;
      };
      if (a.size() == 1) stop = num(0);
      else if (a.size() >= 2) start = num(0), stop = num(1);
      if (a.size() == 3) step = num(2);
      if (a.empty() || a.size() > 3 || step == 0) runtime("bad range() arguments");
      Array out;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(Value::integer(k));
      return Value::array(std::move(out));
    }
    if (name == "raise_exception") runtime(a.empty() ? "raise_exception() called" : a[0].str());
    if (name == "strftime_now") {
      const std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, a.empty() ? "%Y-%m-%d" : a[0].str().c_str(), &tm);
      return Value::string(std::string(buf, n));
    }
    runtime("unknown function '" + name + "'");
  }

  static Value get_attr(const Value& obj, const std::string& name) {
    if (obj.kind == Value::Kind::Object) {
      const Value* v = obj.obj->find(name);
      return v ? *v : Value();
    }
    if (obj.is_undefined()) runtime("'" + name + "' is accessed on an undefined value");
    return Value();  // methods are resolved in call(); plain attributes of others are undefined
  }

  static Value get_index(const Value& obj, const Value& idx) {
    if (obj.kind == Value::Kind::Object) {
      const Value* v = obj.obj->find(idx.str());
      return v ? *v : Value();
    }
    if (obj.kind == Value::Kind::Array || obj.kind == Value::Kind::String) {
      if (idx.kind != Value::Kind::Int) runtime("list index must be an integer");
      const int64_t n = obj.kind == Value::Kind::Array ? int64_t(obj.arr->size()) : int64_t(obj.s.size());
      int64_t k = idx.i < 0 ? idx.i + n : idx.i;
      if (k < 0 || k >= n) return Value();  // Jinja: out of range is undefined
      return obj.kind == Value::Kind::Array ? (*obj.arr)[k] : Value::string(obj.s.substr(size_t(k), 1));
    }
    if (obj.is_undefined()) runtime("indexing an undefined value");
    return Value();
  }

  Value slice(const Expr& e) {
    const Value obj = eval(*e.args[0]);
    auto opt = [&](size_t k, bool& has) -> int64_t {
      has = false;
      if (!e.args[k]) return 0;
      const Value v = eval(*e.args[k]);
      if (v.is_none()) return 0;
      if (v.kind != Value::Kind::Int) runtime("slice bounds must be integers");
      has = true;
      return v.i;
    };
    bool hs, he, hp;
    int64_t start = opt(1, hs), stop = opt(2, he), step = opt(3, hp);
    if (!hp) step = 1;
    if (step == 0) runtime("slice step cannot be zero");
    Array items;
    if (obj.kind == Value::Kind::Array) items = *obj.arr;
    else if (obj.kind == Value::Kind::String) for (char c : obj.s) items.push_back(Value::string(std::string(1, c)));
    else runtime(std::string("cannot slice ") + obj.type_name());
    const int64_t n = int64_t(items.size());
    // Python's slice.indices().
    auto clamp = [&](int64_t v, bool has, int64_t dflt) {
      if (!has) return dflt;
      if (v < 0) v += n;
      if (step > 0) return std::clamp<int64_t>(v, 0, n);
      return std::clamp<int64_t>(v, -1, n - 1);
    };
    start = clamp(start, hs, step > 0 ? 0 : n - 1);
    stop = clamp(stop, he, step > 0 ? n : -1);
    Array out;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(items[k]);
    if (obj.kind == Value::Kind::String) {
      std::string s;
      for (auto& v : out) s += v.s;
      return Value::string(s);
    }
    return Value::array(std::move(out));
  }

  Value binary(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return Value::boolean(values_equal(a, b));
    if (op == "!=") return Value::boolean(!values_equal(a, b));
    if (op == "<") return Value::boolean(compare_values(a, b) < 0);
    if (op == ">") return Value::boolean(compare_values(a, b) > 0);
    if (op == "<=") return Value::boolean(compare_values(a, b) <= 0);
    if (op == ">=") return Value::boolean(compare_values(a, b) >= 0);
    if (op == "~") return Value::string(a.str() + b.str());
    if (op == "in") {
      if (b.is_string()) {
        if (!a.is_string()) runtime("'in <string>' requires a string on the left");
        return Value::boolean(b.s.find(a.s) != std::string::npos);
      }
      if (b.kind == Value::Kind::Object) return Value::boolean(b.obj->find(a.str()) != nullptr);
      if (b.kind == Value::Kind::Array) {
        for (const auto& x : *b.arr)
          if (values_equal(a, x)) return Value::boolean(true);
        return Value::boolean(false);
      }
      if (b.is_undefined()) runtime("'in' on an undefined value");
      runtime(std::string("'in' on ") + b.type_name());
    }
    if (op == "+") {
      if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
      if (a.kind == Value::Kind::Array && b.kind == Value::Kind::Array) {
        Array c = *a.arr;
        c.insert(c.end(), b.arr->begin(), b.arr->end());
        return Value::array(std::move(c));
      }
      if (a.is_undefined() || b.is_undefined()) runtime("'+' with an undefined value");
      if (a.is_string() || b.is_string())
        runtime(std::string("cannot add ") + a.type_name() + " and " + b.type_name());
    }
    if (op == "*" && a.is_string() && b.kind == Value::Kind::Int) {
      std::string s;
      for (int64_t k = 0; k < b.i; ++k) s += a.s;
      return Value::string(s);
    }
    const bool ints = (a.kind == Value::Kind::Int || a.kind == Value::Kind::Bool) &&
                      (b.kind == Value::Kind::Int || b.kind == Value::Kind::Bool);
    const int64_t ia = a.kind == Value::Kind::Bool ? a.b : a.i, ib = b.kind == Value::Kind::Bool ? b.b : b.i;
    const double x = as_double(a, ("'" + op + "'").c_str()), y = as_double(b, ("'" + op + "'").c_str());
    if (op == "+") return ints ? Value::integer(ia + ib) : Value::number(x + y);
    if (op == "-") return ints ? Value::integer(ia - ib) : Value::number(x - y);
    if (op == "*") return ints ? Value::integer(ia * ib) : Value::number(x * y);
    if (op == "/") {
      if (y == 0) runtime("division by zero");
      return Value::number(x / y);
    }
    if (op == "//" || op == "%") {
      if (y == 0) runtime("division by zero");
      if (ints) {
        int64_t q = ia / ib, r = ia % ib;
        if (r != 0 && ((r < 0) != (ib < 0))) --q, r += ib;  // Python floors
        return Value::integer(op == "//" ? q : r);
      }
      const double q = std::floor(x / y);
      return Value::number(op == "//" ? q : x - q * y);
    }
    if (op == "**") return ints && ib >= 0 ? Value::integer(int64_t(std::llround(std::pow(x, y)))) : Value::number(std::pow(x, y));
    runtime("unknown operator " + op);
  }

  struct Args {
    std::vector<Value> pos;
    Kwargs kw;
    const Value* get(size_t k, const char* name) const {
      for (const auto& [key, v] : kw)
        if (key == name) return &v;
      return k < pos.size() ? &pos[k] : nullptr;
    }
  };

  Args eval_args(const Expr& e, size_t first) {
    Args a;
    for (size_t k = first; k < e.args.size(); ++k) a.pos.push_back(eval(*e.args[k]));
    for (const auto& [key, x] : e.kwargs) a.kw.emplace_back(key, eval(*x));
    return a;
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.args[0];
    if (callee.kind == Expr::Attr) {
      Value self = eval(*callee.args[0]);
      const Args a = eval_args(e, 1);
      if (self.kind == Value::Kind::Object) {
        if (const Value* f = self.obj->find(callee.name); f && f->kind == Value::Kind::Function)
          return (*f->fn)(a.pos, a.kw);
      }
      return method(self, callee.name, a);
    }
    const Value f = eval(callee);
    if (f.kind != Value::Kind::Function)
      runtime(callee.kind == Expr::Name ? "'" + callee.name + "' is not callable (undefined function?)"
                                        : std::string("calling a ") + f.type_name());
    const Args a = eval_args(e, 1);
    return (*f.fn)(a.pos, a.kw);
  }

  Value method(const Value& self, const std::string& m, const Args& a) {
    if (self.is_string()) {
      const std::string& s = self.s;
      if (m == "startswith" || m == "endswith") {
        const Value* p = a.get(0, "prefix");
        if (!p) runtime(m + "() needs an argument");
        auto test1 = [&](const std::string& x) {
          return m == "startswith" ? s.rfind(x, 0) == 0
                                   : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
        };
        if (p->kind == Value::Kind::Array) {
          for (const auto& x : *p->arr)
            if (test1(x.str())) return Value::boolean(true);
          return Value::boolean(false);
        }
        return Value::boolean(test1(p->str()));
      }
      if (m == "strip") return Value::string(py_strip(s, a.get(0, "chars"), true, true));
      if (m == "lstrip") return Value::string(py_strip(s, a.get(0, "chars"), true, false));
      if (m == "rstrip") return Value::string(py_strip(s, a.get(0, "chars"), false, true));
      if (m == "split") {
        const Value* ms = a.get(1, "maxsplit");
        return py_split(s, a.get(0, "sep"), ms ? ms->i : -1);
      }
      if (m == "upper" || m == "lower") {
        std::string r = s;
        for (auto& c : r) c = char(m == "upper" ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        return Value::string(r);
      }
      if (m == "replace") {
        if (a.pos.size() < 2) runtime("replace() needs two arguments");
        return Value::string(py_replace(s, a.pos[0].str(), a.pos[1].str(), a.pos.size() > 2 ? a.pos[2].i : -1));
      }
      if (m == "find") {
        if (a.pos.empty()) runtime("find() needs an argument");
        const size_t k = s.find(a.pos[0].str());
        return Value::integer(k == std::string::npos ? -1 : int64_t(k));
      }
      if (m == "count") {
        if (a.pos.empty() || a.pos[0].str().empty()) runtime("count() needs a non-empty argument");
        int64_t n = 0;
        for (size_t k = s.find(a.pos[0].s); k != std::string::npos; k = s.find(a.pos[0].s, k + a.pos[0].s.size())) ++n;
        return Value::integer(n);
      }
    } else if (self.kind == Value::Kind::Object) {
      if (m == "items") return items_of(self);
      if (m == "keys") return Value::array(iterate(self));
      if (m == "values") {
        Array out;
        for (const auto& kv : self.obj->items) out.push_back(kv.second);
        return Value::array(std::move(out));
      }
      if (m == "get") {
        if (a.pos.empty()) runtime("get() needs a key");
        const Value* v = self.obj->find(a.pos[0].str());
        return v ? *v : (a.pos.size() > 1 ? a.pos[1] : Value::none());
      }
    } else if (self.is_undefined()) {
      runtime("'" + m + "()' called on an undefined value");
    }
    runtime(std::string("unsupported method ") + self.type_name() + "." + m + "()");
  }

  bool test(const Expr& e) {
    const Value v = eval(*e.args[0]);
    const std::string& t = e.name;
    if (t == "defined") return !v.is_undefined();
    if (t == "undefined") return v.is_undefined();
    if (t == "none") return v.is_none();
    if (t == "string") return v.is_string();
    if (t == "number") return v.is_number();
    if (t == "integer") return v.kind == Value::Kind::Int;
    if (t == "float") return v.kind == Value::Kind::Float;
    if (t == "boolean") return v.kind == Value::Kind::Bool;
    if (t == "true") return v.kind == Value::Kind::Bool && v.b;
    if (t == "false") return v.kind == Value::Kind::Bool && !v.b;
    if (t == "mapping") return v.kind == Value::Kind::Object;
    if (t == "sequence") return v.kind == Value::Kind::Array || v.is_string();
    if (t == "iterable") return v.kind == Value::Kind::Array || v.is_string() || v.kind == Value::Kind::Object;
    if (t == "callable") return v.kind == Value::Kind::Function;
    if (t == "even" || t == "odd") {
      if (v.kind != Value::Kind::Int) runtime("'" + t + "' test needs an integer");
      return (v.i % 2 == 0) == (t == "even");
    }
    if (t == "eq" || t == "equalto" || t == "==" || t == "ne" || t == "in") {
      if (e.args.size() < 2) runtime("test '" + t + "' needs an argument");
      const Value o = eval(*e.args[1]);
      if (t == "in") return binary("in", v, o).b;
      return values_equal(v, o) == (t != "ne");
    }
    runtime("unsupported test 'is " + t + "'");
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    const Args a = eval_args(e, 1);
    return apply_filter(e.name, v, a);
  }

  Value apply_filter(const std::string& f, const Value& v, const Args& a) {
    if (f == "length" || f == "count") {
      if (v.is_string()) {
        int64_t n = 0;
        for (unsigned char c : v.s) n += (c & 0xC0) != 0x80;
        return Value::integer(n);
      }
      if (v.kind == Value::Kind::Array) return Value::integer(int64_t(v.arr->size()));
      if (v.kind == Value::Kind::Object) return Value::integer(int64_t(v.obj->items.size()));
      if (v.is_undefined()) return Value::integer(0);
      runtime(std::string("length of ") + v.type_name());
    }
    if (f == "tojson") {
      const Value* ind = a.get(0, "indent");
      std::string out;
      py_json(out, v, ind && ind->kind == Value::Kind::Int ? int(ind->i) : -1, 0);
      return Value::string(out);
    }
    if (f == "string") return Value::string(v.str());
    if (f == "trim") return Value::string(py_strip(v.str(), a.get(0, "chars"), true, true));
    if (f == "upper" || f == "lower") return method(Value::string(v.str()), f, {});
    if (f == "capitalize" || f == "title") {
      std::string s = v.str();
      bool start = true;
      for (auto& c : s) {
        const bool alpha = std::isalpha(static_cast<unsigned char>(c));
        c = char(start && alpha ? std::toupper(static_cast<unsigned char>(c))
                                : (f == "title" || !start) ? std::tolower(static_cast<unsigned char>(c)) : c);
        if (f == "title") start = !alpha;
        else start = false;
      }
      return Value::string(s);
    }
    if (f == "default" || f == "d") {
      const Value* dflt = a.get(0, "default_value");
      const Value* boolean = a.get(1, "boolean");
      const bool use = boolean && boolean->truthy() ? !v.truthy() : v.is_undefined();
      return use ? (dflt ? *dflt : Value::string("")) : v;
    }
    if (f == "first" || f == "last") {
      Array items = iterate(v);
      if (items.empty()) return Value();
      return f == "first" ? items.front() : items.back();
    }
    if (f == "join") {
      const Value* sep = a.get(0, "d");
      const Value* attr = a.get(1, "attribute");
      std::string out;
      bool first = true;
      for (const auto& x : iterate(v)) {
        if (!first) out += sep ? sep->str() : "";
        first = false;
        out += (attr ? get_attr(x, attr->str()) : x).str();
      }
      return Value::string(out);
    }
    if (f == "list") return Value::array(iterate(v));
    if (f == "items") return items_of(v);
    if (f == "reverse") {
      if (v.is_string()) return Value::string(std::string(v.s.rbegin(), v.s.rend()));
      Array items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::array(std::move(items));
    }
    if (f == "replace") {
      if (a.pos.size() < 2) runtime("replace filter needs two arguments");
      return Value::string(py_replace(v.str(), a.pos[0].str(), a.pos[1].str(), a.pos.size() > 2 ? a.pos[2].i : -1));
    }
    if (f == "safe" || f == "e" || f == "escape") {
      if (f == "safe") return v;
      runtime("the 'escape' filter is not supported");
    }
    if (f == "int") {
      if (v.kind == Value::Kind::Int) return v;
      if (v.kind == Value::Kind::Float) return Value::integer(int64_t(v.f));
      try {
        return Value::integer(std::stoll(v.str()));
      } catch (...) {
        return Value::integer(0);
      }
    }
    if (f == "float") return Value::number(v.is_number() ? as_double(v, "float") : std::atof(v.str().c_str()));
    if (f == "abs") return v.kind == Value::Kind::Int ? Value::integer(std::llabs(v.i)) : Value::number(std::fabs(as_double(v, "abs")));
    if (f == "selectattr" || f == "rejectattr") {
      const bool want = f == "selectattr";
      if (a.pos.empty()) runtime(f + " needs an attribute name");
      Array out;
      for (const auto& x : iterate(v)) {
        const Value attr = get_attr(x, a.pos[0].str());
        bool ok;
        if (a.pos.size() == 1) {
          ok = attr.truthy();
        } else {
          auto t = mk(Expr::Test, a.pos[1].str());
          auto lit = mk(Expr::Literal);
          lit->lit = attr;
          t->args.push_back(lit);
          if (a.pos.size() > 2) {
            auto arg = mk(Expr::Literal);
            arg->lit = a.pos[2];
            t->args.push_back(arg);
          }
          ok = test(*t);
        }
        if (ok == want) out.push_back(x);
      }
      return Value::array(std::move(out));
    }
    if (f == "map") {
      Array out;
      const Value* attr = a.get(99, "attribute");
      for (const auto& x : iterate(v)) {
        if (attr) out.push_back(get_attr(x, attr->str()));
        else if (!a.pos.empty()) out.push_back(apply_filter(a.pos[0].str(), x, Args{{a.pos.begin() + 1, a.pos.end()}, {}}));
        else runtime("map needs a filter name or attribute=");
      }
      return Value::array(std::move(out));
    }
    runtime("unsupported filter '" + f + "'");
  }

  Scope scope_;
};

}  // namespace

std::string Template::render(const Object& context) const {
  Renderer r(context);
  std::string out;
  r.exec(root_, out);
  return out;
}

}  // namespace flashmoe::jinja
