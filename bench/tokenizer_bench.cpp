// Encoding throughput (MB/s of UTF-8 input) of the byte-level BPE tokenizer
// on a large code text: models/coder-mini/eval/code_heldout.txt, repeated to
// ~2.5 MB, with the coder-mini (4k vocab) and qwen3 (151k vocab) tokenizers.
// "Warm" runs keep the word cache between iterations (the steady state of a
// server); "Cold" reloads the tokenizer so every word goes through BPE.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

// The repository root: bench/ is next to it (CMake passes absolute __FILE__).
const fs::path kRoot = fs::path(__FILE__).parent_path().parent_path();

const std::string& corpus() {
  static const std::string text = [] {
    std::ifstream in(kRoot / "models/coder-mini/eval/code_heldout.txt", std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string one = ss.str();
    std::string all;
    for (int k = 0; k < 4; ++k) all += one;
    return all;
  }();
  return text;
}

std::string model_path(int which) {
  return (which == 0 ? kRoot / "models/coder-mini" : kRoot / "tests/fixtures/tokenizers/qwen3").string();
}

void BM_EncodeWarm(benchmark::State& state) {
  const flashmoe::Tokenizer tok = flashmoe::Tokenizer::load(model_path(int(state.range(0))));
  const std::string& text = corpus();
  size_t n = tok.encode(text).size();  // warm the cache
  for (auto _ : state) {
    auto ids = tok.encode(text);
    n = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
  state.counters["tokens"] = double(n);
  state.counters["bytes/token"] = double(text.size()) / double(n);
  state.SetLabel(state.range(0) == 0 ? "coder-mini" : "qwen3");
}

void BM_EncodeCold(benchmark::State& state) {
  const std::string& text = corpus();
  for (auto _ : state) {
    state.PauseTiming();
    auto tok = std::make_unique<flashmoe::Tokenizer>(flashmoe::Tokenizer::load(model_path(int(state.range(0)))));
    state.ResumeTiming();
    auto ids = tok->encode(text);
    benchmark::DoNotOptimize(ids.data());
    state.PauseTiming();  // keep the destructor out of the timing
    tok.reset();
    state.ResumeTiming();
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
  state.SetLabel(state.range(0) == 0 ? "coder-mini" : "qwen3");
}

void BM_Decode(benchmark::State& state) {
  const flashmoe::Tokenizer tok = flashmoe::Tokenizer::load(model_path(int(state.range(0))));
  const auto ids = tok.encode(corpus());
  for (auto _ : state) {
    auto s = tok.decode(ids);
    benchmark::DoNotOptimize(s.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(corpus().size()));
  state.SetLabel(state.range(0) == 0 ? "coder-mini" : "qwen3");
}

void BM_Load(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(flashmoe::Tokenizer::load(model_path(int(state.range(0)))).vocab_size());
  state.SetLabel(state.range(0) == 0 ? "coder-mini" : "qwen3");
}

}  // namespace

BENCHMARK(BM_EncodeWarm)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeCold)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(BM_Decode)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Load)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK_MAIN();
