#include "tokenizer/pretokenizer.h"

#include "core/error.h"

namespace flashmoe {

namespace {

// The regex GPT-2's ByteLevel pre-tokeniser applies when use_regex is true.
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string quote_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

void PreTokenizer::load(const nlohmann::json& pt) {
  steps_.clear();
  byte_level_ = false;
  if (!pt.is_null()) add_step(pt);
}

void PreTokenizer::add_step(const nlohmann::json& pt) {
  const std::string type = pt.value("type", "");
  if (type == "Sequence") {
    for (const auto& sub : pt.at("pretokenizers")) add_step(sub);
  } else if (type == "Split") {
    Step s;
    const auto& pat = pt.at("pattern");
    if (pat.contains("Regex")) {
      s.regex = std::make_unique<Regex>(pat["Regex"].get<std::string>());
    } else if (pat.contains("String")) {
      s.regex = std::make_unique<Regex>(quote_literal(pat["String"].get<std::string>()));
    } else {
      fail("tokenizer.json: Split pre-tokenizer has no Regex or String pattern");
    }
    if (pt.value("invert", false)) fail("tokenizer.json: Split with invert=true is not supported");
    const std::string behavior = pt.value("behavior", "Isolated");
    if (behavior == "Isolated") s.behavior = Behavior::Isolated;
    else if (behavior == "Removed") s.behavior = Behavior::Removed;
    else fail("tokenizer.json: Split behavior '" + behavior + "' is not supported (Isolated, Removed are)");
    steps_.push_back(std::move(s));
  } else if (type == "ByteLevel") {
    Step s;
    s.is_byte_level = true;
    s.add_prefix_space = pt.value("add_prefix_space", false);
    if (pt.value("use_regex", true)) s.regex = std::make_unique<Regex>(kGpt2Pattern);
    byte_level_ = true;
    steps_.push_back(std::move(s));
  } else {
    fail("tokenizer.json: pre-tokenizer type '" + type + "' is not supported");
  }
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& words,
                         std::deque<std::string>& storage) const {
  std::vector<std::string_view> cur{text}, nxt;
  std::vector<std::pair<size_t, size_t>> matches;
  for (const Step& step : steps_) {
    nxt.clear();
    for (std::string_view piece : cur) {
      // HF applies the ByteLevel prefix space to each piece that exists at
      // this point, not just to the start of the text.
      if (step.add_prefix_space && (piece.empty() || piece[0] != ' ')) {
        storage.push_back(" " + std::string(piece));
        piece = storage.back();
      }
      if (!step.regex) {
        nxt.push_back(piece);
        continue;
      }
      matches.clear();
      step.regex->find_all(piece, matches);
      size_t prev = 0;
      for (auto [b, e] : matches) {
        if (b > prev) nxt.push_back(piece.substr(prev, b - prev));
        if (step.behavior == Behavior::Isolated) nxt.push_back(piece.substr(b, e - b));
        prev = e;
      }
      if (prev < piece.size()) nxt.push_back(piece.substr(prev));
    }
    cur.swap(nxt);
  }
  for (std::string_view w : cur)
    if (!w.empty()) words.push_back(w);
}

}  // namespace flashmoe
