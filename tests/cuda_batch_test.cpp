// Batched decode on the GPU (Backend::forward_batch, continuous batching):
// several sequences of different lengths, joining and leaving at different
// steps, prompt chunks and decode tokens in the same step, against each
// sequence run alone through forward(). Skipped where no GPU is usable (CI).
// CudaBatchBench.DISABLED_* is the throughput bench of gpu-tasks/batch-cuda.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include <thread>

#include "engine/batch_scheduler.h"
#include "engine/generator.h"
#include "kv/presets.h"
#include "tokenizer/tokenizer.h"
#include "runtime/bench_support.h"
#include "test_util.h"
#include "backend/cuda/cuda_bench.h"
#include "backend/cuda/cuda_model.h"
#include "runtime/cuda_backend_impl.h"

namespace cuda_batch_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

int32_t argmax_of(const float* x, int64_t n) { return int32_t(std::max_element(x, x + n) - x); }

// One sequence of a schedule: its prompt, the step it joins at, how many
// tokens it generates (greedy) before it leaves.
struct Seq {
  std::vector<int32_t> prompt;
  int join = 0;
  int gen = 0;
};

// Per sequence: the generated ids and the logits that chose them ([gen][V]).
struct Outcome {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> logits;
};

// Each sequence alone: its whole prompt, then one token at a time.
Outcome run_alone(const Backend& b, const KvConfig& kv, const std::vector<Seq>& seqs, ThreadPool& pool) {
  const int64_t V = b.config().vocab_size;
  Outcome o;
  std::vector<float> l(static_cast<size_t>(V));
  for (const Seq& s : seqs) {
    auto st = b.new_state(kv);
    b.forward(*st, s.prompt.data(), int64_t(s.prompt.size()), LogitsMode::Last, l.data(), pool);
    o.ids.emplace_back();
    o.logits.emplace_back();
    for (int g = 0; g < s.gen; ++g) {
      o.logits.back().insert(o.logits.back().end(), l.begin(), l.end());
      const int32_t next = argmax_of(l.data(), V);
      o.ids.back().push_back(next);
      if (g + 1 < s.gen) b.forward(*st, &next, 1, LogitsMode::Last, l.data(), pool);
    }
  }
  return o;
}

// All of them through forward_batch: from its join step on, a sequence feeds
// its prompt in chunks of up to `chunk` tokens (logits only with the last
// one), then its greedy tokens one per step, in the same steps as the others.
// Every sequence asks for the argmax too (checked against its logits'); with
// odd_ids_only the odd ones ask for the argmax alone (no logits: their
// Outcome logits stay empty). Returns the largest batch of single tokens
// seen, in *widest.
Outcome run_batched(const Backend& b, const KvConfig& kv, const std::vector<Seq>& seqs, int chunk, ThreadPool& pool,
                    int* widest, bool odd_ids_only = false) {
  const int64_t V = b.config().vocab_size;
  const size_t n = seqs.size();
  std::vector<std::unique_ptr<State>> st(n);
  std::vector<size_t> fed(n, 0);
  std::vector<int32_t> next(n, 0), picked(n, -1);
  std::vector<std::vector<float>> buf(n, std::vector<float>(static_cast<size_t>(V)));
  Outcome o;
  o.ids.resize(n);
  o.logits.resize(n);
  *widest = 0;
  for (int step = 0;; ++step) {
    std::vector<BatchItem> items;
    std::vector<size_t> who;
    bool pending = false;
    for (size_t i = 0; i < n; ++i) {
      const Seq& s = seqs[i];
      if (int(o.ids[i].size()) == s.gen) continue;
      pending = true;
      if (s.join > step) continue;
      if (!st[i]) st[i] = b.new_state(kv);
      BatchItem it;
      it.state = st[i].get();
      it.logits = buf[i].data();
      if (fed[i] < s.prompt.size()) {
        it.ids = s.prompt.data() + fed[i];
        it.n = int64_t(std::min(s.prompt.size() - fed[i], size_t(chunk)));
        fed[i] += size_t(it.n);
        it.mode = fed[i] == s.prompt.size() ? LogitsMode::Last : LogitsMode::None;
      } else {
        it.ids = &next[i];
        it.n = 1;
        it.mode = LogitsMode::Last;
      }
      if (it.mode == LogitsMode::Last) {
        it.argmax = &picked[i];
        if (odd_ids_only && i % 2 == 1) it.logits = nullptr;
      }
      items.push_back(it);
      who.push_back(i);
    }
    if (!pending) break;
    int singles = 0;
    for (const BatchItem& it : items) singles += it.n == 1 ? 1 : 0;
    *widest = std::max(*widest, singles);
    b.forward_batch(items.data(), int64_t(items.size()), pool);
    for (size_t j = 0; j < items.size(); ++j) {
      if (items[j].mode != LogitsMode::Last) continue;
      const size_t i = who[j];
      if (items[j].logits) {
        o.logits[i].insert(o.logits[i].end(), buf[i].begin(), buf[i].end());
        EXPECT_EQ(picked[i], argmax_of(buf[i].data(), V)) << "sequence " << i << ": the argmax beside the logits";
      }
      next[i] = picked[i];
      o.ids[i].push_back(next[i]);
    }
  }
  return o;
}

// 8 sequences: prompts of 3 to 38 tokens cut from `ids`, joining at steps
// 0..7 (a later one's prompt chunks run next to the earlier ones' decode
// tokens), generating 5 to 12 tokens (leaving at different steps).
std::vector<Seq> schedule(const std::vector<int32_t>& ids) {
  std::vector<Seq> v;
  for (int i = 0; i < 8; ++i) {
    Seq s;
    const size_t len = std::min(ids.size(), size_t(3 + 5 * ((i * 3) % 8)));
    const size_t at = size_t(i * 7) % std::max<size_t>(1, ids.size() - len + 1);
    s.prompt.assign(ids.begin() + long(at), ids.begin() + long(at + len));
    s.join = i;
    s.gen = 5 + i;
    v.push_back(s);
  }
  return v;
}

// The batched run against the sequences alone: the same greedy ids, and
// logits within the batched prefill's tolerances (cuda_test.cpp's
// max_dlogit: bf16 / f16 KV elements may round the other way when K or V
// differ in the last fp32 bits; fp8 is held to its KL only).
void expect_batch_matches_alone(const Backend& b, const KvConfig& kv, const std::vector<Seq>& seqs,
                                const std::string& label, ThreadPool& pool, bool odd_ids_only = false,
                                int chunk = 4) {
  const int64_t V = b.config().vocab_size;
  const Outcome alone = run_alone(b, kv, seqs, pool);
  int widest = 0;
  const Outcome batch = run_batched(b, kv, seqs, chunk, pool, &widest, odd_ids_only);
  EXPECT_GE(widest, 4) << label << ": the schedule never batched 4 decode tokens";
  const bool fp8 = kv.dtype == KvDType::FP8;
  const float tol = kv.dtype == KvDType::F32 ? 2e-3f : 1e-2f;
  double worst_kl = 0;
  float worst_mad = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(batch.ids[i], alone.ids[i]) << label << " sequence " << i;
    if (batch.ids[i] != alone.ids[i] || batch.logits[i].empty()) continue;
    const double kl = mean_kl(alone.logits[i], batch.logits[i], V);
    const float mad = max_abs_diff(alone.logits[i].data(), batch.logits[i].data(), alone.logits[i].size());
    worst_kl = std::max(worst_kl, kl);
    worst_mad = std::max(worst_mad, mad);
    EXPECT_LE(kl, fp8 ? 1e-3 : 1e-4) << label << " sequence " << i;
    if (!fp8) {
      EXPECT_LE(mad, tol) << label << " sequence " << i;
    }
  }
  std::printf("[cuda-batch] %-28s widest batch %d, worst mean KL %.3g, max |dlogit| %.3g\n", label.c_str(), widest,
              worst_kl, worst_mad);
}

// schedule() over 64 pseudo-random ids (id i: (i * mul + add) % V).
std::vector<Seq> pseudo_random_schedule(int64_t V, int64_t mul, int64_t add) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < 64; ++i) ids.push_back(int32_t((i * mul + add) % V));
  return schedule(ids);
}

std::vector<std::pair<std::string, KvConfig>> kv_formats() {
  std::vector<std::pair<std::string, KvConfig>> v;
  v.push_back({"f32-full", KvConfig{}});
  KvConfig w;
  w.window = 16;  // the longer sequences wrap it
  v.push_back({"f32-window16", w});
  KvConfig b;
  b.dtype = KvDType::BF16;
  v.push_back({"bf16-full", b});
  KvConfig f;
  f.dtype = KvDType::F16;
  v.push_back({"f16-window16", f});
  v.back().second.window = 16;
  KvConfig p;
  p.dtype = KvDType::FP8;
  v.push_back({"fp8-position", p});
  KvConfig ph;
  ph.dtype = KvDType::FP8;
  ph.fp8_scale = Fp8ScaleMode::Head;
  ph.window = 16;
  v.push_back({"fp8-head-window16", ph});
  KvConfig s;
  s.streaming = true;
  s.window = 12;
  v.push_back({"streaming12", s});
  KvConfig h;
  h.h2o_budget = 24;
  v.push_back({"h2o24", h});
  KvConfig t;
  t.tova_budget = 24;
  v.push_back({"tova24", t});
  return v;
}

}  // namespace

// coder-mini, every KV format and retention policy, through the Backend.
TEST(CudaBatch, CoderMiniMatchesEachSequenceAloneForEveryKvConfig) {
  REQUIRE_GPU();
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  auto cuda = CudaModel::upload(*model);
  const Backend& b = gpu_view(*model, *cuda);
  const std::vector<Seq> seqs = schedule(load_ref(dir + "/reference.safetensors", "ids").ids);
  ThreadPool pool(2);
  for (const auto& [name, kv] : kv_formats()) expect_batch_matches_alone(b, kv, seqs, "coder-mini " + name, pool);
  // The eight whole prompts (3 to 38 tokens) in the first step: one prefill
  // pass over all their rows (Prefill::run_rows: the products and experts
  // shared, each sequence's recurrence and attention over its own rows);
  // h2o / tova prompts past their budget attend in order, alone.
  std::vector<Seq> first = seqs;
  for (Seq& s : first) s.join = 0;
  for (const auto& [name, kv] : kv_formats())
    expect_batch_matches_alone(b, kv, first, "coder-mini one step " + name, pool, false, 64);
}

// More sequences than a query's attention split is sized for: step_batch
// halves each group's split while the step's attention blocks exceed 8 an
// SM, so 40 sequences of coder-mini's 8 heads at the forced split of 4
// (1,280 blocks) run at 2 (or 1) on a GPU of fewer than 160 SMs.
TEST(CudaBatch, ManySequencesMatchEachAloneWithTheAttentionSplitCut) {
  REQUIRE_GPU();
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  CudaOptions o;
  o.decode.attention_split = DecodeOptions::AttentionSplit::Force;
  auto cuda = CudaModel::upload(*model, o);
  const Backend& b = gpu_view(*model, *cuda);
  const std::vector<int32_t> ids = load_ref(dir + "/reference.safetensors", "ids").ids;
  std::vector<Seq> seqs;
  for (int i = 0; i < 40; ++i) {
    Seq s;
    const size_t len = std::min(ids.size(), size_t(2 + i % 5));
    const size_t at = size_t(i * 7) % (ids.size() - len + 1);
    s.prompt.assign(ids.begin() + long(at), ids.begin() + long(at + len));
    s.gen = 4 + i % 3;
    seqs.push_back(s);
  }
  ThreadPool pool(2);
  for (const auto& [name, kv] : kv_formats())
    if (name == "f32-full" || name == "fp8-head-window16")
      expect_batch_matches_alone(b, kv, seqs, "coder-mini 40 sequences " + name, pool, false, 64);
}

// The server's greedy path on the GPU: generate() through a BatchScheduler
// (several requests at once, joining at different times) asks for the
// argmax alone, for the prompt's last token and every later one, picked on
// the device (BatchItem::argmax); each request's ids equal its run alone
// through forward() with the logits on the host and their argmax there.
TEST(CudaBatch, ScheduledGreedyGenerateEqualsTheLogitsPath) {
  REQUIRE_GPU();
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  auto cuda = CudaModel::upload(*model);
  const Backend& b = gpu_view(*model, *cuda);
  Tokenizer tok = Tokenizer::load(dir);
  const char* texts[] = {"def add(a, b):\n", "class Stack:\n    def __init__(self):\n", "import os\n",
                         "SELECT name FROM users WHERE", "x = [i * i for i in range(10)]\nprint(",
                         "fn main() {\n    let v = vec![1, 2, 3];\n"};
  const int n = 6, gen = 16;
  std::vector<Seq> seqs;
  for (const char* t : texts) seqs.push_back({tok.encode(t), 0, gen});
  ThreadPool pool(2);
  const Outcome alone = run_alone(b, KvConfig{}, seqs, pool);
  BatchSchedulerOptions so;
  so.step_tokens = 8;  // prompts in chunks, mixed with the others' decoding
  BatchScheduler sched(b, pool, so);
  std::vector<std::vector<int32_t>> got(n);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2 * i));
      Session s(sched, KvConfig{});
      GenerateOptions go;
      go.max_new_tokens = gen;
      go.sampling.temperature = 0;  // plain greedy: the argmax path
      go.sampling.eos_ids.clear();
      got[size_t(i)] = generate(s, tok, seqs[size_t(i)].prompt, go, [](const std::string&) { return true; }).ids;
    });
  for (auto& t : ts) t.join();
  for (int i = 0; i < n; ++i) EXPECT_EQ(got[size_t(i)], alone.ids[size_t(i)]) << "request " << i;
}

// The same with the batched step captured in CUDA graphs (one per batch
// shape, replayed with each step's arguments).
TEST(CudaBatch, CoderMiniThroughGraphsMatchesEachSequenceAlone) {
  REQUIRE_GPU();
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  CudaOptions o;
  o.decode.batch_graph = true;
  auto cuda = CudaModel::upload(*model, o);
  const Backend& b = gpu_view(*model, *cuda);
  const std::vector<Seq> seqs = schedule(load_ref(dir + "/reference.safetensors", "ids").ids);
  ThreadPool pool(2);
  for (const auto& [name, kv] : kv_formats())
    expect_batch_matches_alone(b, kv, seqs, "coder-mini graphs " + name, pool);
}

// Every golden fixture (dense and MoE layers, shared experts or not, both
// architectures), f32 KV.
TEST(CudaBatch, GoldenFixturesMatchEachSequenceAlone) {
  REQUIRE_GPU();
  ThreadPool pool(2);
  for (const char* f : {"tiny-qwen35moe", "tiny-qwen35moe-fused", "tiny-qwen35moe-text", "tiny-qwen35-dense",
                        "tiny-qwen3next", "tiny-qwen3next-sharded"}) {
    const std::string dir = fixture_dir(f);
    auto model = QwenModel::load(dir + "/model");
    auto cuda = CudaModel::upload(*model);
    const std::vector<Seq> seqs = schedule(load_ref(dir + "/reference.safetensors", "ids_long").ids);
    expect_batch_matches_alone(gpu_view(*model, *cuda), KvConfig{}, seqs, f, pool);
  }
}

// The 35B's shapes (config_35b_4_layers).
TEST(CudaBatch, MatchesEachSequenceAloneAt35bShapes) {
  REQUIRE_GPU();
  const ModelConfig c = config_35b_4_layers();
  auto b = synthetic_backend(c, QuantKind::None, 64, GpuOptions{});
  const std::vector<Seq> seqs = pseudo_random_schedule(c.vocab_size, 7919, 13);
  ThreadPool pool(2);
  for (const auto& [name, kv] : kv_formats())
    if (name == "f32-full" || name == "bf16-full" || name == "fp8-head-window16" || name == "h2o24")
      expect_batch_matches_alone(*b, kv, seqs, "35b-shapes " + name, pool);
  // The eight whole prompts in the first step: one prefill pass of 164 rows
  // (the routed experts over many rows each, the tiled product).
  std::vector<Seq> first = seqs;
  for (Seq& s : first) s.join = 0;
  for (const auto& [name, kv] : kv_formats())
    if (name == "f32-full" || name == "fp8-head-window16")
      expect_batch_matches_alone(*b, kv, first, "35b-shapes one step " + name, pool, false, 64);
}

// Heads the staged delta rule does not take (delta_staged_fits): value
// heads of 256 columns (the decode step's cluster kernel, a cluster of 8
// blocks per head) and key heads of 256 (one block per head).
TEST(CudaBatch, MatchesEachSequenceAloneWhereTheStagedDeltaRuleDoesNotFit) {
  REQUIRE_GPU();
  ThreadPool pool(2);
  for (const bool wide_keys : {false, true}) {
    ModelConfig c = config_35b_4_layers();
    (wide_keys ? c.lin_k_dim : c.lin_v_dim) = 256;
    auto b = synthetic_backend(c, QuantKind::None, 64, GpuOptions{});
    const std::vector<Seq> seqs = pseudo_random_schedule(c.vocab_size, 7919, 31);
    expect_batch_matches_alone(*b, KvConfig{}, seqs, wide_keys ? "35b-shapes dk 256" : "35b-shapes dv 256", pool);
  }
}

// The routed experts forced through each product (the tiled one,
// few_rows_kernel and skinny_gemm_kernel: the default picks by rows per
// expert, so a schedule of 8 sequences alone would reach only one of
// them) with plain launches; then in graphs the tiled product (whose
// gate/up writes the down product's split activations) and the default's
// choice at these few rows (the skinny product: its grouped tiles under
// PDL); the odd sequences taking only their argmax (picked on the device,
// no logits copied).
TEST(CudaBatch, EachExpertProductMatchesEachSequenceAlone) {
  REQUIRE_GPU();
  const ModelConfig c = config_35b_4_layers();
  auto b = synthetic_backend(c, QuantKind::None, 64, GpuOptions{});
  CudaModel& dev = dynamic_cast<const CudaBackend&>(*b).device_for_bench();
  const std::vector<Seq> seqs = pseudo_random_schedule(c.vocab_size, 104729, 7);
  ThreadPool pool(2);
  using Path = DecodeOptions::BatchExperts;
  struct Run {
    Path experts;
    const char* name;
    bool graphs;
  };
  for (const Run& r : {Run{Path::Tiled, "tiled", false}, Run{Path::FewRows, "few-rows", false},
                       Run{Path::Skinny, "skinny", false}, Run{Path::Tiled, "tiled", true},
                       Run{Path::Auto, "auto", true}}) {
    cuda_set_batch_graph(dev, r.graphs);
    cuda_set_batch_experts(dev, r.experts);
    const std::string name = std::string("35b-shapes experts ") + r.name + (r.graphs ? " graphs" : "");
    expect_batch_matches_alone(*b, KvConfig{}, seqs, name, pool, true);
  }
  cuda_set_batch_experts(dev, Path::Auto);
  cuda_set_batch_graph(dev, false);
}

// Misuse: one state twice in a batch is an Error before anything runs.
TEST(CudaBatch, OneStateTwiceIsAnError) {
  REQUIRE_GPU();
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  auto cuda = CudaModel::upload(*model);
  const Backend& b = gpu_view(*model, *cuda);
  ThreadPool pool(2);
  auto st = b.new_state(KvConfig{});
  const int32_t id = 1;
  BatchItem it{st.get(), &id, 1, LogitsMode::None, nullptr};
  BatchItem two[2] = {it, it};
  EXPECT_THROW(b.forward_batch(two, 2, pool), Error);
  EXPECT_EQ(st->position(), 0);
}

// Throughput of batched decode on the 35B synthetic (all 40 layers) at
// B = 1, 8, 32, 64: aggregate tokens/s with the argmax picked on the
// device, against the bytes-touched roofline of each B (session 6's
// kernels were measured beside these in session 7: bench/NOTES-cuda.md,
// batch-more; bench/results/session7-h200-round2-batch-more.txt). A bench, not a test (nothing to pass or fail): run by
// gpu-tasks/batch-more.sh with --gtest_also_run_disabled_tests.
//
// Bytes one step over B sequences must move (bench/NOTES.md, batched decode):
//   weights: the non-expert weights once + of each MoE layer's E routed
//            experts the expected union the B tokens pick, E * (1 - (1 -
//            k/E)^B), each 3 * H * I * 2 bytes (bf16);
//   KV:      each sequence's cache read once per attention layer;
//   states:  each sequence's delta-rule state read and written per
//            GatedDeltaNet layer (nv * dk * dv fp32; printed apart: the
//            issue's formula leaves it out).
TEST(CudaBatchBench, DISABLED_DecodeThroughputAt35b) {
  REQUIRE_GPU();
  const ModelConfig c = model_preset("qwen3.5-35b-a3b");
  auto b = synthetic_backend(c, QuantKind::None, 64, GpuOptions{});
  ThreadPool pool(2);
  const double gbps = weight_memory_bandwidth(*b, pool).gbps;
  const int64_t V = c.vocab_size, E = c.num_experts, k = c.num_experts_per_tok;
  int64_t moe = 0, lin = 0, attn = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) moe += c.layer_is_moe.empty() || c.layer_is_moe[size_t(l)] ? 1 : 0;
  const double expert = 3.0 * double(c.hidden_size) * double(c.moe_intermediate) * 2;
  const double non_expert = double(b->weight_bytes_per_token()) - double(moe * k) * expert;
  const KvConfig kv;  // f32, full
  const int prompt = 32, warm = 3, steps = 16;
  for (const LayerKind kind : c.layer_kinds) (kind == LayerKind::Full ? attn : lin) += 1;
  std::printf("[batch-bench] qwen3.5-35b-a3b synthetic, bf16, KV f32; bandwidth %.0f GB/s (device copy); "
              "non-expert %.2f GB, expert %.2f MB, %lld MoE layers of %lld experts, top-%lld\n",
              gbps, non_expert / 1e9, expert / 1e6, (long long)moe, (long long)E, (long long)k);
  CudaModel& dev = dynamic_cast<const CudaBackend&>(*b).device_for_bench();
  // Experts chosen per B, graphs. The routed-expert paths
  // (DecodeOptions::batch_experts) were measured side by side in session 6
  // (bench/NOTES-cuda.md, batch-fixed); session 8's changes (the delta rule
  // staged through shared memory, PDL) against session 7's kernels in its
  // two H200 rounds (bench/results/session8-h200-round*-batch-step.txt).
  double tps1 = 0;
  cuda_set_batch_graph(dev, true);
  for (int B : {1, 8, 32, 64}) {
    std::vector<std::unique_ptr<State>> st;
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(B));
    std::vector<int32_t> best(static_cast<size_t>(B));
    std::vector<BatchItem> items(static_cast<size_t>(B));
    for (int i = 0; i < B; ++i) {
      st.push_back(b->new_state(kv));
      for (int t = 0; t < prompt; ++t) prompts[size_t(i)].push_back(int32_t((i * 104729 + t * 7919 + 1) % V));
      items[size_t(i)] = BatchItem{st.back().get(), prompts[size_t(i)].data(), prompt, LogitsMode::None, nullptr};
    }
    b->forward_batch(items.data(), B, pool);  // the prompts (batched prefill, one sequence at a time)
    std::vector<int32_t> tok(static_cast<size_t>(B));
    // Each row's argmax picked on the device (a greedy sequence).
    int s_next = 0;
    auto timed = [&](int n) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < n; ++s, ++s_next) {
        for (int i = 0; i < B; ++i) {
          // Pseudo-random tokens (routing as random as the union formula assumes).
          tok[size_t(i)] = int32_t((int64_t(s_next) * 7919 + int64_t(i) * 104729 + 17) % V);
          items[size_t(i)] =
              BatchItem{st[size_t(i)].get(), &tok[size_t(i)], 1, LogitsMode::Last, nullptr, &best[size_t(i)]};
        }
        b->forward_batch(items.data(), B, pool);
      }
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    timed(warm);
    const double sec_id = timed(steps);
    const double tps = double(B) * steps / sec_id;
    if (B == 1) tps1 = tps;
    const double ctx = prompt + warm + steps;  // mean context over the steps timed
    const double union_frac = 1.0 - std::pow(1.0 - double(k) / double(E), double(B));
    const double w = non_expert + double(moe) * double(E) * union_frac * expert;
    const double kvb = double(B) * double(attn) * ctx * 2.0 * double(c.num_kv_heads * c.head_dim) * 4;
    const double sb = double(B) * double(lin) * 2.0 * double(c.lin_num_v_heads * c.lin_k_dim * c.lin_v_dim) * 4;
    const double roof = double(B) / ((w + kvb) / (gbps * 1e9));
    const double roof_s = double(B) / ((w + kvb + sb) / (gbps * 1e9));
    std::printf("[batch-bench] B=%-3d argmax on device %8.1f tokens/s (%.2f ms/step), %.2fx B=1; "
                "experts touched %.1f%%; bytes/step %.2f GB weights + %.3f GB KV (+ %.2f GB delta states); "
                "roofline %.0f tokens/s -> %.1f%% (with states: %.0f -> %.1f%%)\n",
                B, tps, sec_id / steps * 1e3, tps1 > 0 ? tps / tps1 : 0.0, 100 * union_frac, w / 1e9,
                kvb / 1e9, sb / 1e9, roof, 100 * tps / roof, roof_s, 100 * tps / roof_s);
  }
  cuda_set_batch_graph(dev, false);
}

// A server's admission of B prompts at once, on the 35B synthetic: making
// B states, then their prompts (P tokens each) one sequence at a time
// through forward() against all of them in one forward_batch (prompt rows
// of several sequences in one prefill pass), then the first decode step
// over the B. Round 0 takes the last logits of both and prints how far
// apart they are (not a check: over 40 random layers a rounding-level
// difference flips near-tied expert choices, and the logits move by up to
// ~1; CudaBatch.MatchesEachSequenceAloneAt35bShapes is the check, at 4
// layers); round 1, timed, the argmax on the device alone (a greedy
// server's request).
TEST(CudaBatchBench, DISABLED_PromptAdmissionAt35b) {
  REQUIRE_GPU();
  const ModelConfig c = model_preset("qwen3.5-35b-a3b");
  auto b = synthetic_backend(c, QuantKind::None, 64, GpuOptions{});
  ThreadPool pool(2);
  const int64_t V = c.vocab_size;
  const KvConfig kv;
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count() * 1e3; };
  for (int P : {24, 64}) {
    for (int B : {8, 32}) {
      std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(B));
      for (int i = 0; i < B; ++i)
        for (int t = 0; t < P; ++t) prompts[size_t(i)].push_back(int32_t((i * 104729 + t * 7919 + 1) % V));
      std::vector<int32_t> best(static_cast<size_t>(B)), tok(static_cast<size_t>(B));
      std::vector<std::vector<float>> la(static_cast<size_t>(B), std::vector<float>(size_t(V))), ls = la;
      double ms_new = 0, ms_alone = 0, ms_shared = 0, ms_step = 0;
      float worst = 0, worst_halves = 0;
      double kl = 0;
      for (int round = 0; round < 2; ++round) {
        const bool logits = round == 0;
        std::vector<std::unique_ptr<State>> a, s;
        auto t0 = Clock::now();
        for (int i = 0; i < B; ++i) a.push_back(b->new_state(kv));
        ms_new = since(t0);
        for (int i = 0; i < B; ++i) s.push_back(b->new_state(kv));
        t0 = Clock::now();
        for (int i = 0; i < B; ++i) {
          const BatchItem it{a[size_t(i)].get(), prompts[size_t(i)].data(), P, LogitsMode::Last,
                             logits ? la[size_t(i)].data() : nullptr, &best[size_t(i)]};
          b->forward_batch(&it, 1, pool);
        }
        ms_alone = since(t0);
        std::vector<BatchItem> items;
        for (int i = 0; i < B; ++i)
          items.push_back(BatchItem{s[size_t(i)].get(), prompts[size_t(i)].data(), P, LogitsMode::Last,
                                    logits ? ls[size_t(i)].data() : nullptr, &tok[size_t(i)]});
        t0 = Clock::now();
        b->forward_batch(items.data(), B, pool);
        ms_shared = since(t0);
        if (logits)
          for (int i = 0; i < B; ++i) {
            worst = std::max(worst, max_abs_diff(la[size_t(i)].data(), ls[size_t(i)].data(), size_t(V)));
            kl += mean_kl(la[size_t(i)], ls[size_t(i)], V);
            // The same prompt alone in two chunks (today's code both ways):
            // how far rounding alone moves this model's logits.
            auto h = b->new_state(kv);
            const int half = P / 2;
            std::vector<float> l2(static_cast<size_t>(V));
            b->forward(*h, prompts[size_t(i)].data(), half, LogitsMode::None, nullptr, pool);
            b->forward(*h, prompts[size_t(i)].data() + half, P - half, LogitsMode::Last, l2.data(), pool);
            worst_halves = std::max(worst_halves, max_abs_diff(la[size_t(i)].data(), l2.data(), size_t(V)));
          }
        for (int i = 0; i < B; ++i)
          items[size_t(i)] = BatchItem{s[size_t(i)].get(), &tok[size_t(i)], 1, LogitsMode::Last, nullptr,
                                       &best[size_t(i)]};
        t0 = Clock::now();
        b->forward_batch(items.data(), B, pool);
        ms_step = since(t0);
      }
      std::printf("[admission] B=%-2d P=%-2d new_state x B %.1f ms; prompts one at a time %.1f ms, in one pass %.1f ms "
                  "(%.2fx; mean KL %.2g, max |dlogit| %.2g; alone in two chunks: %.2g); first decode step %.1f ms\n",
                  B, P, ms_new, ms_alone, ms_shared, ms_alone / ms_shared, kl / B, worst, worst_halves, ms_step);
    }
  }
}

}  // namespace cuda_batch_test
