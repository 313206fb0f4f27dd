#include "engine/grammar.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace flashmoe {

using Op = Grammar::Op;

// ---- building ----

uint32_t GrammarBuilder::new_rule(std::string name) {
  g_.rule_names.push_back(std::move(name));
  alts_.emplace_back();
  return uint32_t(alts_.size() - 1);
}

void GrammarBuilder::add_alternative(uint32_t rule, const Seq& seq) { alts_.at(rule).push_back(seq); }

Grammar::Element GrammarBuilder::bytes(const std::bitset<256>& set) {
  for (size_t i = 0; i < g_.byte_sets.size(); ++i)
    if (g_.byte_sets[i] == set) return {Op::Bytes, uint32_t(i), 0, 0};
  g_.byte_sets.push_back(set);
  return {Op::Bytes, uint32_t(g_.byte_sets.size() - 1), 0, 0};
}

Grammar::Element GrammarBuilder::byte(uint8_t b) {
  std::bitset<256> s;
  s.set(b);
  return bytes(s);
}

Grammar::Element GrammarBuilder::byte_range(uint8_t lo, uint8_t hi) {
  std::bitset<256> s;
  for (unsigned c = lo; c <= hi; ++c) s.set(c);
  return bytes(s);
}

void GrammarBuilder::append_literal(Seq& seq, std::string_view text) {
  for (unsigned char c : text) seq.push_back(byte(c));
}

Grammar GrammarBuilder::finish(uint32_t root) {
  g_.elements.clear();
  g_.rules.assign(alts_.size(), {});
  for (size_t r = 0; r < alts_.size(); ++r) {
    if (alts_[r].empty()) fail("grammar: rule '" + g_.rule_names[r] + "' has no alternatives");
    for (const Seq& seq : alts_[r]) {
      g_.rules[r].push_back(uint32_t(g_.elements.size()));
      for (const auto& e : seq) {
        if (e.op == Op::Ref && e.arg >= alts_.size()) fail("grammar: reference to an unknown rule");
        g_.elements.push_back(e);
      }
      g_.elements.push_back({});
    }
  }
  g_.root = root;
  // Shortest completions by fixed point: start from "none", lower until
  // nothing changes (each pass can only shorten).
  g_.min_rest.assign(g_.elements.size(), Grammar::kUnbounded);
  auto add = [](uint32_t a, uint32_t b) -> uint32_t {
    if (a == Grammar::kUnbounded || b == Grammar::kUnbounded) return Grammar::kUnbounded;
    return uint32_t(std::min<uint64_t>(uint64_t(a) + b, Grammar::kUnbounded - 1));
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = g_.elements.size(); i-- > 0;) {
      const Grammar::Element& e = g_.elements[i];
      uint32_t v = 0;
      if (e.op != Op::End) {
        const uint32_t self = e.op == Op::Bytes ? 1 : e.op == Op::String ? e.min + 1 : g_.min_length(e.arg);
        v = add(self, g_.min_rest[i + 1]);
      }
      if (v < g_.min_rest[i]) g_.min_rest[i] = v, changed = true;
    }
  }
  return std::move(g_);
}

uint32_t Grammar::min_length(uint32_t rule) const {
  uint32_t best = kUnbounded;
  for (uint32_t alt : rules[rule]) best = std::min(best, min_rest[alt]);
  return best;
}

namespace {
std::string byte_set_text(const std::bitset<256>& s) {
  auto show = [](unsigned c) {
    static const char* hex = "0123456789ABCDEF";
    std::string out;
    if (c >= 0x21 && c < 0x7F && c != ']' && c != '\\' && c != '-' && c != '"') {
      out.push_back(char(c));
    } else {
      out.append("\\x");
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
    return out;
  };
  if (s.count() == 1)
    for (unsigned c = 0; c < 256; ++c)
      if (s[c]) {
        std::string one = "\"";
        one.append(show(c)).push_back('"');
        return one;
      }
  std::string out = "[";
  for (unsigned c = 0; c < 256;) {
    if (!s[c]) {
      ++c;
      continue;
    }
    unsigned e = c;
    while (e + 1 < 256 && s[e + 1]) ++e;
    out += show(c);
    if (e > c) {
      out.push_back('-');
      out += show(e);
    }
    c = e + 1;
  }
  out.push_back(']');
  return out;
}
}  // namespace

std::string Grammar::to_string() const {
  std::string out;
  for (size_t r = 0; r < rules.size(); ++r) {
    out += rule_names[r] + " ::=";
    for (size_t a = 0; a < rules[r].size(); ++a) {
      if (a) out += " |";
      uint32_t p = rules[r][a];
      if (elements[p].op == Op::End) out += " \"\"";
      for (; elements[p].op != Op::End; ++p) {
        const Element& e = elements[p];
        out.push_back(' ');
        if (e.op == Op::Bytes) out += byte_set_text(byte_sets[e.arg]);
        else if (e.op == Op::Ref) out += rule_names[e.arg];
        else out += "string-body{" + std::to_string(e.min) + "," + (e.max == kUnbounded ? "" : std::to_string(e.max)) + "}";
      }
    }
    out += "\n";
  }
  return out;
}

// ---- stacks ----

void GrammarStacks::add(std::span<const GrammarFrame> s) {
  for (size_t i = 0; i < size(); ++i) {
    auto t = stack(i);
    if (t.size() == s.size() && std::equal(t.rbegin(), t.rend(), s.rbegin())) return;  // tops differ first
  }
  // Parses that stay apart this long mean a grammar no schema needs (the
  // compiler bounds anyOf and shares enum prefixes); refused rather than
  // letting every byte cost that much.
  if (size() >= kMaxStacks)
    fail("structured output: the schema leaves more than " + std::to_string(kMaxStacks) +
         " ways open at one point; simplify it (fewer overlapping anyOf/oneOf alternatives or optional properties)");
  frames_.insert(frames_.end(), s.begin(), s.end());
  ends_.push_back(uint32_t(frames_.size()));
}

bool GrammarStacks::accepting() const {
  for (size_t i = 0; i < size(); ++i)
    if (stack(i).empty()) return true;
  return false;
}

bool GrammarStacks::can_continue() const {
  for (size_t i = 0; i < size(); ++i)
    if (!stack(i).empty()) return true;
  return false;
}

uint32_t GrammarStacks::min_bytes_to_accept(const Grammar& g) const {
  uint32_t best = Grammar::kUnbounded;
  for (size_t i = 0; i < size(); ++i) best = std::min(best, min_bytes_to_accept(g, stack(i)));
  return best;
}

uint32_t GrammarStacks::min_bytes_to_accept(const Grammar& g, std::span<const GrammarFrame> s) {
  {
    uint64_t d = 0;
    for (size_t k = 0; k + 1 < s.size(); ++k) d += g.min_rest[s[k].pos];
    if (!s.empty()) {
      const GrammarFrame& f = s.back();
      const Grammar::Element& e = g.elements[f.pos];
      if (e.op == Grammar::Op::String) {
        d += (f.count < e.min ? e.min - f.count : 0) + (f.sub == 1 ? 1 : f.sub >= 2 ? f.need : 0) + 1;
        d += g.min_rest[f.pos + 1];
      } else {
        d += g.min_rest[f.pos];
      }
    }
    return uint32_t(std::min<uint64_t>(d, Grammar::kUnbounded));
  }
}

void GrammarStacks::append_key(std::string& key) const {
  for (size_t i = 0; i < size(); ++i) {
    auto s = stack(i);
    const uint32_t n = uint32_t(s.size());
    key.append(reinterpret_cast<const char*>(&n), sizeof n);
    for (const GrammarFrame& f : s) {
      const uint8_t raw[12] = {uint8_t(f.pos), uint8_t(f.pos >> 8), uint8_t(f.pos >> 16), uint8_t(f.pos >> 24),
                               uint8_t(f.count), uint8_t(f.count >> 8), uint8_t(f.count >> 16),
                               uint8_t(f.count >> 24), f.sub, f.need, f.lo, f.hi};
      key.append(reinterpret_cast<const char*>(raw), sizeof raw);
    }
  }
}

// ---- matching ----

namespace {

// A chain of rule references this deep without a byte in between can only
// come from a rule that reaches itself before consuming anything (the
// compiler rejects such schemas; this keeps a bad grammar from overflowing
// the call stack).
constexpr int kMaxExpansionDepth = 2000;

// `s` is a stack whose top may be a rule reference: adds to `out` every stack
// it stands for whose top is a byte-consuming element (or the empty stack).
void expand(const Grammar& g, std::vector<GrammarFrame>& s, GrammarStacks& out, int depth) {
  if (s.empty() || g.elements[s.back().pos].op != Op::Ref) {
    out.add(s);
    return;
  }
  if (depth > kMaxExpansionDepth) fail("grammar: a rule refers to itself before matching any input");
  const GrammarFrame top = s.back();
  s.pop_back();
  const size_t base = s.size();
  // The return position; none when the reference ends its alternative (a
  // tail call: right recursion does not grow the stack).
  if (g.elements[top.pos + 1].op != Op::End) s.push_back(GrammarFrame{top.pos + 1});
  const size_t with_return = s.size();
  for (uint32_t alt : g.rules[g.elements[top.pos].arg]) {
    s.resize(with_return);
    if (g.elements[alt].op != Op::End) s.push_back(GrammarFrame{alt});
    expand(g, s, out, depth + 1);
  }
  s.resize(base);
  s.push_back(top);
}

// The element at the top of `s` is done: pop it, move on in its alternative.
void finish_top(const Grammar& g, std::vector<GrammarFrame>& s, GrammarStacks& out) {
  const uint32_t pos = s.back().pos;
  s.pop_back();
  if (g.elements[pos + 1].op != Op::End) s.push_back(GrammarFrame{pos + 1});
  expand(g, s, out, 0);
}

// One byte into a String frame; false if it is not allowed there.
// Returns true with `done` set when the byte is the closing quote.
bool string_byte(const Grammar::Element& e, GrammarFrame& f, uint8_t b, bool& done) {
  done = false;
  auto start_char = [&] {
    if (f.count >= e.max) return false;
    // Without an upper bound only "at least min" matters: counting stops
    // there, so the state (and the mask cache) stops changing.
    if (e.max != Grammar::kUnbounded || f.count < e.min) ++f.count;
    return true;
  };
  switch (f.sub) {
    case 0:  // between characters
      if (b == '"') {
        if (f.count < e.min) return false;
        done = true;
        return true;
      }
      if (b < 0x20) return false;
      if (b == '\\') {
        if (!start_char()) return false;
        f.sub = 1;
        return true;
      }
      if (b < 0x80) return start_char();
      {
        uint8_t need = 0, lo = 0x80, hi = 0xBF;
        if (b >= 0xC2 && b <= 0xDF) need = 1;
        else if (b == 0xE0) need = 2, lo = 0xA0;
        else if (b == 0xED) need = 2, hi = 0x9F;  // no UTF-16 surrogates
        else if (b >= 0xE1 && b <= 0xEF) need = 2;
        else if (b == 0xF0) need = 3, lo = 0x90;
        else if (b >= 0xF1 && b <= 0xF3) need = 3;
        else if (b == 0xF4) need = 3, hi = 0x8F;
        else return false;
        if (!start_char()) return false;
        f.sub = 2, f.need = need, f.lo = lo, f.hi = hi;
        return true;
      }
    case 1:  // after a backslash
      if (b == 'u') {
        f.sub = 3, f.need = 4, f.lo = 0;
        return true;
      }
      if (!std::strchr("\"\\/bfnrt", b) || b == 0) return false;
      f.sub = 0;
      return true;
    case 2:  // UTF-8 continuation
      if (b < f.lo || b > f.hi) return false;
      f.lo = 0x80, f.hi = 0xBF;
      if (--f.need == 0) f.sub = 0;
      return true;
    case 3: {  // \uXXXX; a surrogate (D800-DFFF) would need a pair: refused
      const bool hex = (b >= '0' && b <= '9') || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F');
      if (!hex) return false;
      if (f.need == 4 && (b == 'd' || b == 'D')) f.lo = 1;
      else if (f.need == 3 && f.lo == 1 && !(b >= '0' && b <= '7')) return false;
      if (--f.need == 0) f.sub = 0, f.lo = 0;
      return true;
    }
  }
  return false;
}

}  // namespace

bool plain_string_chars(std::string_view bytes, uint32_t& chars) {
  const Grammar::Element body{Op::String, 0, 0, Grammar::kUnbounded - 1};
  GrammarFrame f;
  bool done = false;
  for (unsigned char c : bytes)
    if (c == '\\' || !string_byte(body, f, c, done) || done) return false;
  chars = f.count;
  return f.sub == 0 && !bytes.empty();
}

void GrammarMatcher::step(const Grammar& g, const GrammarStacks& in, uint8_t b, GrammarStacks& out) {
  out.clear();
  thread_local std::vector<GrammarFrame> s;
  for (size_t i = 0; i < in.size(); ++i) {
    auto st = in.stack(i);
    if (st.empty()) continue;
    const Grammar::Element& e = g.elements[st.back().pos];
    if (e.op == Op::Bytes) {
      if (!g.byte_sets[e.arg][b]) continue;
      s.assign(st.begin(), st.end());
      finish_top(g, s, out);
    } else {  // Op::String (expansion leaves nothing else on top)
      GrammarFrame f = st.back();
      bool done = false;
      if (!string_byte(e, f, b, done)) continue;
      s.assign(st.begin(), st.end());
      s.back() = f;
      if (done) finish_top(g, s, out);
      else out.add(s);
    }
  }
}

GrammarMatcher::GrammarMatcher(const Grammar& g) : g_(&g) {
  std::vector<GrammarFrame> s;
  if (g.rules.empty()) fail("grammar: no rules");
  // The root as a one-element reference: expand it like any other.
  for (uint32_t alt : g.rules[g.root]) {
    s.clear();
    if (g.elements[alt].op != Op::End) s.push_back(GrammarFrame{alt});
    expand(g, s, stacks_, 0);
  }
}

bool GrammarMatcher::feed(std::string_view bytes) {
  GrammarStacks cur = stacks_;
  for (unsigned char c : bytes) {
    step(*g_, cur, c, scratch_);
    if (scratch_.empty()) return false;
    std::swap(cur, scratch_);
  }
  stacks_ = std::move(cur);
  return true;
}

}  // namespace flashmoe
