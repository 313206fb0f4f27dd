// `flashmoe tokenize` / `flashmoe detokenize`: text <-> ids through the
// model's tokenizer.json, one JSON value per line (for checks and scripting).
#include <memory>

#include "cli/command.h"
#include "cli/jsonl_io.h"
#include "tokenizer/gguf_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace flashmoe::cli {
namespace {

struct Options {
  std::string model;
  bool split_special = false;
  bool skip_special = false;
};

void setup_tokenize(CLI::App& app) {
  auto opt = std::make_shared<Options>();
  auto* sub = app.add_subcommand("tokenize", "Encode text: one JSON string per stdin line -> one JSON id array per line");
  sub->add_option("-m,--model", opt->model, "Model directory, tokenizer.json or .gguf file")->required();
  sub->add_flag("--split-special", opt->split_special, "Encode special-token text as plain text");
  sub->callback([opt] {
    const Tokenizer tok = load_tokenizer(opt->model);
    for_each_json_line([&](size_t n, const nlohmann::ordered_json& j) {
      if (!j.is_string()) fail("stdin line " + std::to_string(n) + ": expected a JSON string, got " + j.type_name());
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(j.get_ref<const std::string&>(), opt->split_special);
      } catch (const Error& e) {
        fail("stdin line " + std::to_string(n) + ": " + e.what());
      }
      write_line(nlohmann::json(ids).dump());
    });
  });
}

void setup_detokenize(CLI::App& app) {
  auto opt = std::make_shared<Options>();
  auto* sub = app.add_subcommand("detokenize", "Decode ids: one JSON id array per stdin line -> one JSON string per line");
  sub->add_option("-m,--model", opt->model, "Model directory, tokenizer.json or .gguf file")->required();
  sub->add_flag("--skip-special", opt->skip_special, "Leave special tokens out of the text");
  sub->callback([opt] {
    const Tokenizer tok = load_tokenizer(opt->model);
    for_each_json_line([&](size_t n, const nlohmann::ordered_json& j) {
      bool ok = j.is_array();
      if (ok)
        for (const auto& e : j) ok = ok && e.is_number_integer();
      if (!ok) fail("stdin line " + std::to_string(n) + ": expected a JSON array of integer ids");
      // The ids the tokenizer knows, as generate and logits check theirs.
      const int64_t vocab = int64_t(tok.vocab_size());
      std::vector<int32_t> ids;
      for (const auto& e : j) {
        const bool neg = e.is_number_integer() && !e.is_number_unsigned() && e.get<int64_t>() < 0;
        if (neg || e.get<uint64_t>() >= uint64_t(vocab))
          fail("stdin line " + std::to_string(n) + ": token id " + e.dump() +
               " is out of range: the vocabulary has " + std::to_string(vocab) + " tokens (0.." +
               std::to_string(vocab - 1) + ")");
        ids.push_back(int32_t(e.get<int64_t>()));
      }
      write_line(nlohmann::json(tok.decode(ids, opt->skip_special)).dump());
    });
  });
}

const Registrar reg_tokenize(50, setup_tokenize);
const Registrar reg_detokenize(51, setup_detokenize);

}  // namespace
}  // namespace flashmoe::cli
