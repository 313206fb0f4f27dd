// The MTP head on the CUDA backend (--mtp --device cuda): its logits against
// the CPU's head and against the torch reference of coder-mini's trained
// head, and greedy speculative decoding identical to plain decoding token
// for token. Skipped (with the reason) where no GPU is usable, e.g. in CI.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "backend/cuda/cuda_bench.h"
#include "backend/cuda/cuda_model.h"
#include "core/argmax.h"
#include "engine/session.h"
#include "engine/speculative.h"
#include "kv/presets.h"
#include "runtime/cuda_backend_impl.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace cuda_mtp_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

std::string coder_mini() { return source_path("models/coder-mini"); }

// coder-mini (which has an MTP head) loaded and uploaded: b serves sessions
// on the GPU, V is its vocabulary.
struct CoderMiniOnGpu {
  std::unique_ptr<QwenModel> model = QwenModel::load(coder_mini() + "/model");
  std::unique_ptr<CudaModel> cuda = CudaModel::upload(*model);
  const Backend& b = gpu_view(*model, *cuda);
  const int64_t V = model->config().vocab_size;
};

// The first n ids of coder-mini's reference text (code: the head drafts
// well there); where the copy of coder-mini has no reference text (the GPU
// machine's), a few lines of code repeated, through its tokenizer.
std::vector<int32_t> code_prompt(size_t n) {
  const std::string ref = coder_mini() + "/reference.safetensors";
  std::vector<int32_t> ids;
  if (std::filesystem::exists(ref)) {
    ids = load_ref(ref, "ids").ids;
  } else {
    const Tokenizer tok = Tokenizer::load(coder_mini() + "/tokenizer.json");
    std::string text;
    while (ids.size() < n) {
      text += "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n";
      ids = tok.encode(text);
    }
  }
  ids.resize(std::min(n, ids.size()));
  return ids;
}

KvConfig fp8_head() {
  KvConfig c;
  c.dtype = KvDType::FP8;
  c.fp8_scale = Fp8ScaleMode::Head;
  return c;
}
KvConfig half_kv(KvDType t) {
  KvConfig c;
  c.dtype = t;
  return c;
}
KvConfig window(int64_t w) {
  KvConfig c;
  c.window = w;
  return c;
}

// The head's logits of an n-step draft after `next`, each step fed `steps[k]`.
std::vector<float> draft_logits(Session& s, int32_t next, const std::vector<int32_t>& steps) {
  const int64_t V = s.backend().config().vocab_size;
  std::vector<float> out;
  s.draft(next, int64_t(steps.size()), [&](const float* l, int64_t k) {
    out.insert(out.end(), l, l + V);
    return steps[size_t(k)];
  });
  return out;
}

}  // namespace

// The CUDA head against the CPU head, after a prompt through the batched
// prefill and after tokens fed one at a time (the decode step), so both
// ways of keeping the head's KV cache in step are covered: 3 draft steps
// each, on the same tokens.
TEST(CudaMtp, HeadLogitsMatchTheCpu) {
  REQUIRE_GPU();
  auto model = QwenModel::load(coder_mini() + "/model");
  ASSERT_TRUE(model->plan().mtp.has_value());
  auto cuda = CudaModel::upload(*model);
  ASSERT_TRUE(cuda->has_mtp());
  const int64_t V = model->config().vocab_size;
  ThreadPool pool(2);
  const std::vector<int32_t> prompt = code_prompt(60);
  for (const KvConfig& kv : {KvConfig{}, window(32)}) {
    Session cpu(cpu_of(*model), kv, pool, true), gpu(gpu_view(*model, *cuda), kv, pool, true);
    std::vector<int32_t> head(prompt.begin(), prompt.begin() + 40);
    const int32_t next = int32_t(argmax(cpu.feed(head).data(), V));
    gpu.feed(head);
    const std::vector<int32_t> steps = {prompt[41], prompt[42], prompt[43]};
    std::vector<float> a = draft_logits(cpu, next, steps), b = draft_logits(gpu, next, steps);
    const float d1 = max_abs_diff(a.data(), b.data(), a.size());
    const double kl1 = mean_kl(a, b, V);
    // Then token by token (the decode step), and a draft again.
    for (size_t i = 40; i < 56; ++i) {
      cpu.feed({prompt[i]});
      gpu.feed({prompt[i]});
    }
    a = draft_logits(cpu, prompt[56], steps);
    b = draft_logits(gpu, prompt[56], steps);
    const float d2 = max_abs_diff(a.data(), b.data(), a.size());
    const double kl2 = mean_kl(a, b, V);
    std::printf("[cuda-mtp] %-10s head logits vs cpu: after prefill max |d| %.3g KL %.3g; after steps max |d| %.3g KL %.3g\n",
                kv.describe().c_str(), d1, kl1, d2, kl2);
    EXPECT_LE(d1, 5e-3f) << kv.describe();
    EXPECT_LE(d2, 5e-3f) << kv.describe();
    EXPECT_LE(kl1, 1e-4) << kv.describe();
    EXPECT_LE(kl2, 1e-4) << kv.describe();
  }
}

// coder-mini's trained head on the GPU against the torch reference written
// when it was trained (as Mtp.CoderMiniHeadMatchesTorchReference on the CPU):
// every 8th prefix's first draft, and the second draft step.
TEST(CudaMtp, CoderMiniHeadMatchesTorchReference) {
  REQUIRE_GPU();
  const std::string ref = fixture_dir("mtp") + "/coder-mini-reference.safetensors";
  if (!std::filesystem::exists(ref)) GTEST_SKIP() << "tests/fixtures/mtp is not here";
  const CoderMiniOnGpu gpu;
  const int64_t V = gpu.V;
  RefTensor ids = load_ref(ref, "ids"), want = load_ref(ref, "mtp_logits");
  const int64_t step2_at = load_ref(ref, "step2_at").ids.at(0);
  const int32_t step2_token = load_ref(ref, "step2_token").ids.at(0);
  RefTensor step2 = load_ref(ref, "step2_logits");
  ThreadPool pool(2);
  Session s(gpu.b, {}, pool, true);
  float worst = 0;
  int64_t checked = 0;
  for (int64_t p = 1; p + 1 < int64_t(ids.ids.size()); ++p) {
    s.feed({ids.ids[size_t(p - 1)]});
    if (p % 8 != 0 && p != step2_at) continue;
    std::vector<std::vector<float>> got;
    const int64_t steps = p == step2_at ? 2 : 1;
    s.draft(ids.ids[size_t(p)], steps, [&](const float* l, int64_t k) {
      got.emplace_back(l, l + V);
      return k == 0 ? step2_token : 0;
    });
    const float d = max_abs_diff(got[0].data(), want.f32.data() + (p - 1) * V, size_t(V));
    worst = std::max(worst, d);
    EXPECT_LE(d, 2e-3f) << "entry " << p - 1;
    if (steps == 2) {
      EXPECT_LE(max_abs_diff(got[1].data(), step2.f32.data(), size_t(V)), 2e-3f) << "second step";
    }
    ++checked;
  }
  std::printf("[cuda-mtp] head vs torch reference: %lld prefixes, max |dlogit| %.3g\n", (long long)checked, worst);
  EXPECT_GT(checked, 4);
}

// Greedy decoding with --mtp on the GPU gives plain decoding's tokens, for
// every draft length 1-4, with full, fp8 and windowed KV caches; the
// roll-back after a rejected draft included (the acceptance is printed).
TEST(CudaMtp, GreedyWithMtpEqualsPlainDecoding) {
  REQUIRE_GPU();
  const CoderMiniOnGpu gpu;
  const Backend& b = gpu.b;
  ThreadPool pool(2);
  const std::vector<int32_t> prompt = code_prompt(48);
  const int64_t n = 40;
  for (const KvConfig& kv : {KvConfig{}, fp8_head(), window(40)}) {
    Session plain(b, kv, pool);
    plain.feed(prompt);
    const std::vector<int32_t> want = plain.greedy(n);
    for (int draft = 1; draft <= 4; ++draft) {
      Session s(b, kv, pool, true);
      SpecStats st;
      EXPECT_EQ(greedy_speculative(s, s.feed(prompt), n, draft, &st), want) << kv.describe() << " draft " << draft;
      EXPECT_GT(st.rounds, 0);
      std::printf("[cuda-mtp] %-10s N=%d %s\n", kv.describe().c_str(), draft, st.describe().c_str());
    }
  }
}

// The verify pass (a drafting state fed 2..8 tokens over a full cache: the
// batched decode step with rows of one sequence, verify.cu) against the
// batched prefill of a plain state and against the CPU, for every full-cache
// KV format; each row's argmax on the device (feed_argmax_rows) against the
// rows' logits; then take_back to every row against a state fed only the
// kept tokens one at a time (the decode step): the same logits after one
// more token and the same drafts. A windowed cache keeps the prefill path,
// which has nothing to take back.
TEST(CudaMtp, VerifyPassMatchesThePrefillAndTakesBackToAnyRow) {
  REQUIRE_GPU();
  const CoderMiniOnGpu gpu;
  const Backend& b = gpu.b;
  const int64_t V = gpu.V;
  ThreadPool pool(2);
  const std::vector<int32_t> text = code_prompt(90);
  const std::vector<int32_t> ctx(text.begin(), text.begin() + 60), rows(text.begin() + 60, text.begin() + 65);
  const int64_t p0 = int64_t(ctx.size()), n = int64_t(rows.size());
  const int32_t more = text[70];
  const std::vector<int32_t> steps = {text[71], text[72]};
  for (const KvConfig& kv : {KvConfig{}, half_kv(KvDType::BF16), half_kv(KvDType::F16), fp8_head()}) {
    Session ref(b, kv, pool), cpu(cpu_of(*gpu.model), kv, pool), s(b, kv, pool, true);
    ref.feed(ctx);
    cpu.feed(ctx);
    s.feed(ctx);
    EXPECT_TRUE(s.state().keeps_rows(n)) << kv.describe();
    EXPECT_FALSE(ref.state().keeps_rows(n)) << "not a drafting state";
    EXPECT_FALSE(s.state().keeps_rows(9)) << "more than 8 tokens";
    const std::vector<float> want = ref.feed_all(rows), wcpu = cpu.feed_all(rows), got = s.feed_all(rows);
    const float d = max_abs_diff(got.data(), want.data(), got.size()), dc = max_abs_diff(got.data(), wcpu.data(), got.size());
    std::printf("[cuda-mtp] %-10s verify pass of %lld rows: max |d| vs the prefill %.3g (KL %.3g), vs the cpu %.3g (KL %.3g)\n",
                kv.describe().c_str(), (long long)n, d, mean_kl(want, got, V), dc, mean_kl(wcpu, got, V));
    EXPECT_LE(d, 2e-3f) << kv.describe();
    EXPECT_LE(mean_kl(want, got, V), 1e-6) << kv.describe();
    EXPECT_LE(mean_kl(wcpu, got, V), 1e-4) << kv.describe();
    EXPECT_FALSE(s.take_back(p0)) << "before the pass";
    Session a(b, kv, pool, true);
    a.feed(ctx);
    const std::vector<int32_t> best = a.feed_argmax_rows(rows);
    for (int64_t t = 0; t < n; ++t) EXPECT_EQ(best[size_t(t)], argmax(got.data() + t * V, V)) << "row " << t;
    for (int64_t k = 0; k < n; ++k) {
      Session v(b, kv, pool, true), w(b, kv, pool, true);
      v.feed(ctx);
      w.feed(ctx);
      v.feed_all(rows);
      ASSERT_TRUE(v.take_back(p0 + k + 1)) << kv.describe() << " row " << k;
      EXPECT_EQ(v.position(), p0 + k + 1);
      for (int64_t t = 0; t <= k; ++t) w.feed({rows[size_t(t)]});
      EXPECT_EQ(v.tokens(), w.tokens());
      const std::vector<float> lv = v.feed({more}), lw = w.feed({more});
      const float dl = max_abs_diff(lv.data(), lw.data(), size_t(V));
      const std::vector<float> hv = draft_logits(v, text[73], steps), hw = draft_logits(w, text[73], steps);
      const float dh = max_abs_diff(hv.data(), hw.data(), hv.size());
      // The verify pass (the batched step's products) and the token-by-token
      // decode (matvecs) compute each K/V value a few fp32 ulps apart; a
      // cache of 8 mantissa bits or fewer can round the two to neighbouring
      // values (2^-8 apart in bf16), which moved the next logits by up to
      // 2.1e-3 here (session 20, bf16, row 3). The distributions must still
      // agree (KL) and pick the same token; a wrong state taken back moves
      // both far more.
      const bool coarse = kv.dtype == KvDType::BF16 || kv.dtype == KvDType::FP8;
      EXPECT_LE(dl, coarse ? 1e-2f : 2e-3f) << kv.describe() << " taken back to row " << k;
      EXPECT_LE(mean_kl(lw, lv, V), 1e-6) << kv.describe() << " taken back to row " << k;
      EXPECT_EQ(argmax(lv.data(), V), argmax(lw.data(), V)) << kv.describe() << " taken back to row " << k;
      EXPECT_LE(dh, coarse ? 1e-2f : 2e-3f) << kv.describe() << " head after taking back to row " << k;
      if (k == 0 || k == n - 1)
        std::printf("[cuda-mtp] %-10s taken back to row %lld: next logits max |d| %.3g, drafts %.3g\n",
                    kv.describe().c_str(), (long long)k, dl, dh);
    }
  }
  Session wdw(b, window(32), pool, true);
  wdw.feed(ctx);
  EXPECT_FALSE(wdw.state().keeps_rows(n));
  wdw.feed_all(rows);
  EXPECT_FALSE(wdw.take_back(p0 + 1)) << "a windowed cache verifies through the prefill";
}

// A drafting state's snapshot carries the head: restored, it drafts and
// decodes as the state it was taken from.
TEST(CudaMtp, SnapshotCarriesTheHead) {
  REQUIRE_GPU();
  const CoderMiniOnGpu gpu;
  const Backend& b = gpu.b;
  const int64_t V = gpu.V;
  ThreadPool pool(2);
  const std::vector<int32_t> prompt = code_prompt(30);
  Session s(b, {}, pool, true);
  const int32_t next = int32_t(argmax(s.feed(prompt).data(), V));
  SessionSnapshot snap = s.snapshot();
  const std::vector<int32_t> steps = {prompt[1], prompt[2]};
  const std::vector<float> before = draft_logits(s, next, steps);
  s.feed({next, 5, 6, 7});  // moves on; the restore must bring the head back
  Session t(b, {}, pool, true);
  t.restore(snap);
  const std::vector<float> after = draft_logits(t, next, steps);
  EXPECT_EQ(before, after);
  Session plain(b, {}, pool);
  EXPECT_THROW(plain.restore(snap), Error);
}

// The device restore point (State::rollback_point, speculative decoding's
// roll-back) against a snapshot in host memory: after feeding 3 tokens and
// restoring, the same 3 tokens give the same logits bit for bit (full and
// windowed caches, fp8 too), and the head drafts as before; and what each
// costs at ~600 tokens of context (printed; the restore point copies no KV),
// and a snapshot kept in VRAM (printed).
TEST(CudaMtp, RestorePointIsExactAndCheaperThanASnapshot) {
  REQUIRE_GPU();
  const CoderMiniOnGpu gpu;
  // A backend of its own: its snapshots go to host memory (a VRAM budget of
  // 0) until the last timing.
  auto own = own_gpu_backend(*gpu.model, *gpu.cuda);
  CudaBackend& b = *own;
  b.set_snapshot_vram_budget(0);
  const int64_t V = gpu.V;
  ThreadPool pool(2);
  std::vector<int32_t> ctx;
  const std::vector<int32_t> text = code_prompt(200);
  while (ctx.size() < 600) ctx.insert(ctx.end(), text.begin(), text.end());
  const std::vector<int32_t> more = {text[5], text[6], text[7]}, steps = {text[8], text[9]};
  for (const KvConfig& kv : {KvConfig{}, window(64), fp8_head()}) {
    Session s(b, kv, pool, true);
    const int32_t next = int32_t(argmax(s.feed(ctx).data(), V));
    const std::vector<float> d0 = draft_logits(s, next, steps);
    SessionSnapshot rp = s.rollback_point();
    const std::vector<float> a = s.feed_all(more);
    s.restore(rp);
    EXPECT_EQ(s.position(), int64_t(ctx.size())) << kv.describe();
    EXPECT_EQ(draft_logits(s, next, steps), d0) << kv.describe();
    const std::vector<float> c = s.feed_all(more);
    EXPECT_EQ(a, c) << kv.describe();
    // Cost: 5 rounds of each (mark, feed 3, restore).
    auto time = [&](bool device) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < 5; ++r) {
        SessionSnapshot p = device ? s.rollback_point() : s.snapshot();
        s.feed_all(more);
        s.restore(p);
      }
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 5;
    };
    time(true);
    const double snap = time(false), dev = time(true);
    b.set_snapshot_vram_budget(size_t(1) << 32);
    const double vram = time(false);
    b.set_snapshot_vram_budget(0);
    std::printf("[cuda-mtp] %-10s context %zu: feed 3 + roll back: host snapshot %.3f ms, VRAM snapshot %.3f ms, "
                "device restore point %.3f ms\n",
                kv.describe().c_str(), ctx.size(), snap, vram, dev);
    EXPECT_LT(dev, snap) << kv.describe();
  }
}

// A synthetic model's random head (bench --mtp --synthetic) drafts on the
// device: greedy drafts (each step's argmax on the device, one copy of the
// ids at the end) equal the same drafts picked on the host from each step's
// logits. (Its buffers once lacked the device drafts: bench --mtp failed.)
TEST(CudaMtp, SyntheticHeadDraftsOnTheDeviceAsOnTheHost) {
  REQUIRE_GPU();
  const ModelConfig c = config_35b_4_layers();
  CudaSyntheticOptions so;
  so.mtp_head = true;
  auto m = cuda_synthetic_model(c, 11, {}, so);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 9; ++i) prompt.push_back(int32_t((i * 7919 + 5) % c.vocab_size));
  const int64_t V = c.vocab_size;
  constexpr int64_t kDrafts = 4;
  auto drafts = [&](bool on_host) {
    auto st = m->new_state(KvConfig{}, true);
    m->forward(*st, prompt.data(), int64_t(prompt.size()), LogitsMode::None, nullptr);
    std::vector<int32_t> out(kDrafts);
    CudaDraftPicker pick;
    if (on_host) pick = [&](const float* l, int64_t) { return int32_t(argmax(l, V)); };
    m->draft(*st, prompt.back(), kDrafts, pick, out.data());
    return out;
  };
  const std::vector<int32_t> dev = drafts(false), host = drafts(true);
  EXPECT_EQ(dev, host);
  for (int32_t t : dev) EXPECT_TRUE(t >= 0 && t < V) << t;
}

}  // namespace cuda_mtp_test
