// Speculative decoding with the MTP head (--mtp): loading the head in every
// tensor layout, greedy output identical to plain decoding token for token
// (any draft length, windows, fp8 KV, snapshot/restore), the head's cache kept
// consistent, and sampled output unchanged in distribution (chi-square over
// many seeds). The heads are RANDOM (scripts/fixtures/add_mtp_head.py): the
// model rarely accepts their drafts, so the accept paths are also driven by
// overriding drafts with known tokens.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>

#include "engine/generator.h"
#include "engine/speculative.h"
#include "tokenizer/tokenizer.h"
#include "server/metrics.h"
#include "test_util.h"

namespace mtp_test {

using namespace flashmoe;
using namespace flashmoe::test;

namespace {

bool sanitizer() { return std::getenv("FLASHMOE_SANITIZER") != nullptr; }

// A model directory: a fixture's model with its random MTP head beside it.
struct MtpModel {
  TempDir dir;
  std::unique_ptr<QwenModel> model;
  explicit MtpModel(const std::string& fixture) {
    const std::string src = fixture_dir(fixture) + "/model";
    for (const auto& e : std::filesystem::directory_iterator(src))
      std::filesystem::create_symlink(e.path(), dir.path + "/" + e.path().filename().string());
    std::filesystem::create_symlink(fixture_dir("mtp") + "/" + fixture + ".safetensors", dir.path + "/mtp.safetensors");
    model = QwenModel::load(dir.path);
  }
};

const std::vector<int32_t> kPrompt = {11, 42, 7, 300, 5, 99, 123, 64, 2, 18};

std::vector<int32_t> plain_greedy(const Backend& b, const KvConfig& kv, int64_t n) {
  ThreadPool pool(2);
  Session s(b, kv, pool);
  s.feed(kPrompt);
  return s.greedy(n);
}

KvConfig window(int64_t w) {
  KvConfig c;
  c.window = w;
  return c;
}
KvConfig h2o(int64_t budget) {
  KvConfig c;
  c.h2o_budget = budget;
  return c;
}
KvConfig tova(int64_t budget) {
  KvConfig c;
  c.tova_budget = budget;
  return c;
}
KvConfig fp8() {
  KvConfig c;
  c.dtype = KvDType::FP8;
  c.fp8_scale = Fp8ScaleMode::Head;
  return c;
}

class MtpLayouts : public ::testing::TestWithParam<const char*> {};

TEST_P(MtpLayouts, HeadLoadsAndGreedyIsUnchanged) {
  MtpModel m(GetParam());
  ASSERT_TRUE(m.model->weights().mtp.has_value());
  ASSERT_TRUE(m.model->plan().mtp.has_value());
  EXPECT_EQ(m.model->plan().mtp->ffn, FfnKind::RoutedMoE);
  const Backend& b = cpu_of(*m.model);
  const int64_t n = sanitizer() ? 12 : 20;
  // The KV formats and retention once (the layouts differ only in loading).
  std::vector<KvConfig> kvs{KvConfig{}};
  if (std::string(GetParam()) == "tiny-qwen35moe") kvs = {KvConfig{}, window(8), fp8(), h2o(12), tova(12)};
  for (const KvConfig& kv : kvs) {
    const std::vector<int32_t> want = plain_greedy(b, kv, n);
    for (int draft = 1; draft <= 4; ++draft) {
      ThreadPool pool(2);
      // The head's own drafts (nearly all rejected by the model)...
      Session s(b, kv, pool, /*drafting=*/true);
      SpecStats st;
      EXPECT_EQ(greedy_speculative(s, s.feed(kPrompt), n, draft, &st), want) << kv.describe() << " draft " << draft;
      EXPECT_EQ(s.position(), int64_t(kPrompt.size()) + n - 1);
      EXPECT_GT(st.drafted, 0);
      // ...and drafts that are the right tokens except at every third
      // position: long accepted runs, rejections in every place of a round.
      Session o(b, kv, pool, /*drafting=*/true);
      SamplingParams g;
      g.temperature = 0;
      Sampler greedy(g);
      SpecStats so;
      auto oracle = [&](int64_t pos, int64_t, int32_t) {
        const int32_t right = want[size_t(pos - int64_t(kPrompt.size()))];
        return pos % 3 == 0 ? (right + 1) % 512 : right;
      };
      EXPECT_EQ(sample_speculative(o, greedy, o.feed(kPrompt), n, draft, &so, oracle), want)
          << kv.describe() << " draft " << draft << " (oracle drafts)";
      EXPECT_GT(so.accepted, 0);
      EXPECT_LT(so.accepted, so.drafted);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpLayouts,
                         ::testing::Values("tiny-qwen35moe", "tiny-qwen3next", "tiny-qwen35moe-fused"));

// After speculative decoding (verify passes, roll-backs), the head drafts
// exactly what a state that was fed the same tokens plainly drafts: its KV
// cache and hidden state were kept in step.
TEST(Mtp, HeadStateConsistentAfterSpeculation) {
  MtpModel m("tiny-qwen35moe");
  const Backend& b = cpu_of(*m.model);
  ThreadPool pool(2);
  Session s(b, {}, pool, true);
  std::vector<int32_t> gen = greedy_speculative(s, s.feed(kPrompt), 20, 3);
  Session ref(b, {}, pool, true);
  std::vector<int32_t> all = kPrompt;
  all.insert(all.end(), gen.begin(), gen.end() - 1);
  for (int32_t t : all) ref.feed({t});  // token by token: every entry made separately
  ASSERT_EQ(s.position(), ref.position());
  std::vector<std::vector<float>> a, r;
  auto record = [](std::vector<std::vector<float>>* into) {
    return [into](const float* l, int64_t) {
      into->emplace_back(l, l + 512);
      return int32_t(std::max_element(l, l + 512) - l);
    };
  };
  s.draft(gen.back(), 3, record(&a));
  ref.draft(gen.back(), 3, record(&r));
  ASSERT_EQ(a.size(), 3u);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_LE(max_abs_diff(a[k].data(), r[k].data(), 512), 1e-3f) << "step " << k;
}

// After a round whose drafts were all wrong (rejected at the first), the
// rolled-back state equals, bit for bit, a state fed the same tokens plainly:
// the same next-token logits and the same head drafts (the CPU's prefill
// and decode give the same bits).
TEST(Mtp, RollBackAfterARejectionEqualsPlainFeeding) {
  MtpModel m("tiny-qwen35moe");
  const Backend& b = cpu_of(*m.model);
  const int64_t V = b.config().vocab_size;
  ThreadPool pool(2);
  for (const KvConfig& kv : {KvConfig{}, window(12)}) {
    Session s(b, kv, pool, true);
    const int32_t next = int32_t(argmax(s.feed(kPrompt).data(), V));
    SamplingParams g;
    g.temperature = 0;
    Sampler greedy(g);
    Speculator spec(s, greedy);
    // Draft 3 tokens that are never the argmax: the first is rejected.
    spec.set_draft_override([&](int64_t, int64_t, int32_t d) { return (d + 1) % int32_t(V); });
    Speculator::Round r = spec.round(next, 3);
    Session ref(b, kv, pool, true);
    ref.feed(kPrompt);
    const std::vector<float> want = ref.feed({next});
    ASSERT_EQ(s.position(), ref.position()) << kv.describe();
    if (r.accepted == 0) {
      EXPECT_EQ(std::vector<float>(r.logits.begin(), r.logits.begin() + V), want) << kv.describe();
      // The states continue alike: the next token's logits, bit for bit.
      EXPECT_EQ(s.feed({r.tokens[0]}), ref.feed({r.tokens[0]})) << kv.describe();
    }
    EXPECT_EQ(r.accepted, 0) << kv.describe();
  }
}

// The restore point (State::rollback_point: the recurrent states copied, the
// KV caches truncated) against a snapshot (everything copied), on
// coder-mini's trained head at ~600 tokens of context: after feeding 3
// tokens and going back, the same tokens give the same logits bit for bit,
// the head drafts the same, and the restore point costs less (printed).
TEST(Mtp, RestorePointIsExactAndCheaperThanASnapshot) {
  const std::string dir = source_path("models/coder-mini/model");
  if (!std::filesystem::exists(dir + "/mtp.safetensors")) GTEST_SKIP() << "no coder-mini head";
  auto model = QwenModel::load(dir);
  const Backend& b = cpu_of(*model);
  const int64_t V = b.config().vocab_size;
  ThreadPool pool(2);
  std::vector<int32_t> ctx;
  for (int i = 0; ctx.size() < (sanitizer() ? 100u : 600u); ++i) ctx.push_back(int32_t((i * 7919 + 13) % 3000));
  const std::vector<int32_t> more = {11, 12, 13};
  Session s(b, {}, pool, true);
  const int32_t next = int32_t(argmax(s.feed(ctx).data(), V));
  auto drafts = [&] {
    std::vector<float> out;
    s.draft(next, 2, [&](const float* l, int64_t) {
      out.insert(out.end(), l, l + V);
      return int32_t(7);
    });
    return out;
  };
  const std::vector<float> d0 = drafts();
  SessionSnapshot rp = s.rollback_point();
  EXPECT_LT(rp.state->bytes(), s.snapshot().state->bytes());
  const std::vector<float> a = s.feed_all(more);
  s.restore(rp);
  EXPECT_EQ(s.position(), int64_t(ctx.size()));
  EXPECT_EQ(drafts(), d0);
  EXPECT_EQ(s.feed_all(more), a);
  auto time = [&](bool point) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < 5; ++r) {
      SessionSnapshot p = point ? s.rollback_point() : s.snapshot();
      s.restore(p);
    }
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 5;
  };
  const double snap = time(false), point = time(true);
  std::printf("[mtp] context %zu: mark + roll back: snapshot %.3f ms (%zu bytes), restore point %.3f ms (%zu bytes)\n",
              ctx.size(), snap, s.snapshot().state->bytes(), point, rp.state->bytes());
}

// bench --mtp-accept: with acceptance 1 every drafted token is kept, with 0
// none; the passes and counts as derived by hand for 17 tokens, 3 drafts per
// pass: at 1, passes from 1 token to 5, 9, 13, 17 (4 passes, 12 drafted, all
// kept); at 0, one token per pass while 3 fit before the 17th (13 passes of
// 3), then passes of 2 and 1, and the 17th token from a plain step (15
// passes, 42 drafted, none kept). At 0.5 about half are kept.
TEST(Mtp, ForcedAcceptanceKeepsEveryDraftOrNone) {
  MtpModel m("tiny-qwen35moe");
  const Backend& b = cpu_of(*m.model);
  ThreadPool pool(2);
  // 17 tokens, 3 drafts per pass, every draft kept with probability `accept`.
  auto run17 = [&](double accept) {
    Session s(b, {}, pool, true);
    SpecStats st;
    const std::vector<int32_t> out = greedy_speculative(s, s.feed(kPrompt), 17, 3, &st, accept, 1);
    EXPECT_EQ(out.size(), 17u);
    EXPECT_EQ(s.position(), int64_t(kPrompt.size()) + 16);
    return st;
  };
  {
    const SpecStats st = run17(1.0);
    EXPECT_EQ(st.rounds, 4);
    EXPECT_EQ(st.drafted, 12);
    EXPECT_EQ(st.accepted, 12);
    EXPECT_EQ(st.emitted, 16);
  }
  {
    const SpecStats st = run17(0.0);
    EXPECT_EQ(st.rounds, 15);
    EXPECT_EQ(st.drafted, 42);
    EXPECT_EQ(st.accepted, 0);
    EXPECT_EQ(st.emitted, 15);
  }
  {
    Session s(b, {}, pool, true);
    SpecStats st;
    greedy_speculative(s, s.feed(kPrompt), sanitizer() ? 61 : 121, 1, &st, 0.5, 7);
    const double a = double(st.accepted) / double(st.drafted);
    EXPECT_GT(a, 0.35);
    EXPECT_LT(a, 0.65);
  }
}

// A conversation snapshotted part-way continues identically after restore.
TEST(Mtp, SnapshotRestoreContinuesIdentically) {
  MtpModel m("tiny-qwen3next");
  const Backend& b = cpu_of(*m.model);
  ThreadPool pool(2);
  const std::vector<int32_t> want = plain_greedy(b, {}, 30);
  Session s(b, {}, pool, true);
  std::vector<int32_t> first = greedy_speculative(s, s.feed(kPrompt), 12, 2);
  SessionSnapshot snap = s.snapshot();
  Session t(b, {}, pool, true);
  t.restore(snap);
  std::vector<int32_t> tail = greedy_speculative(t, t.feed({first.back()}), 18, 4);
  first.insert(first.end(), tail.begin(), tail.end());
  EXPECT_EQ(first, want);
  // A plain state's snapshot does not go into a drafting one.
  Session plain(b, {}, pool);
  plain.feed(kPrompt);
  EXPECT_THROW(t.restore(plain.snapshot()), Error);
}

TEST(Mtp, ModelWithoutHeadIsAClearError) {
  auto model = QwenModel::load(fixture_dir("tiny-qwen35moe") + "/model");
  EXPECT_FALSE(model->plan().mtp.has_value());
  ThreadPool pool(1);
  try {
    Session s(cpu_of(*model), {}, pool, true);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no MTP head"), std::string::npos) << e.what();
  }
}

// Wilson-Hilferty: the chi-square quantile at upper tail 1e-4 (z = 3.719).
double chi2_critical(int df) {
  const double z = 3.719, a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

// Two-sample chi-square homogeneity statistic over the categories both
// samples share; categories with fewer than 10 hits in all are pooled.
std::pair<double, int> chi2(const std::map<int32_t, int>& x, const std::map<int32_t, int>& y) {
  std::map<int32_t, std::pair<int, int>> c;
  for (auto [k, v] : x) c[k].first += v;
  for (auto [k, v] : y) c[k].second += v;
  std::vector<std::pair<int, int>> cells;
  std::pair<int, int> rest{0, 0};
  for (auto& [k, v] : c) {
    if (v.first + v.second < 10) {
      rest.first += v.first;
      rest.second += v.second;
    } else {
      cells.push_back(v);
    }
  }
  if (rest.first + rest.second > 0) cells.push_back(rest);
  double nx = 0, ny = 0;
  for (auto& v : cells) nx += v.first, ny += v.second;
  double s = 0;
  for (auto& v : cells) {
    const double tot = v.first + v.second;
    const double ex = tot * nx / (nx + ny), ey = tot * ny / (nx + ny);
    s += (v.first - ex) * (v.first - ex) / ex + (v.second - ey) * (v.second - ey) / ey;
  }
  return {s, int(cells.size()) - 1};
}

// Sampling (temperature 0.5, top-k 4): the 2nd and 3rd tokens (the drafted
// ones) have the frequencies plain sampling gives. The drafts are the greedy
// tokens, which the model accepts often but not always: a rule that keeps
// drafts too often (or too rarely) skews these frequencies far past the bound.
TEST(Mtp, SampledDistributionUnchanged) {
  MtpModel m("tiny-qwen35moe");
  const Backend& b = cpu_of(*m.model);
  ThreadPool pool(2);
  const int trials = sanitizer() ? 200 : 600;
  const std::vector<int32_t> greedy = plain_greedy(b, {}, 4);
  SamplingParams p;
  p.temperature = 0.5f;
  p.top_k = 4;
  Session plain(b, {}, pool), spec(b, {}, pool, true);
  const std::vector<float> l0 = plain.feed(kPrompt), l1 = spec.feed(kPrompt);
  const SessionSnapshot s0 = plain.snapshot(), s1 = spec.snapshot();
  std::map<int32_t, int> want[3], got[3];
  SpecStats st;
  for (int i = 0; i < trials; ++i) {
    p.seed = uint64_t(i);
    Sampler a(p);
    plain.restore(s0);
    int32_t t = a.sample(l0);
    ++want[0][t];
    for (int k = 1; k < 3; ++k) ++want[k][t = a.sample(plain.feed({t}))];
    p.seed = uint64_t(i) + 1000003;
    Sampler c(p);
    spec.restore(s1);
    auto draft_greedy = [&](int64_t pos, int64_t, int32_t) { return greedy[size_t(pos - int64_t(kPrompt.size()))]; };
    std::vector<int32_t> out = sample_speculative(spec, c, l1, 3, 2, &st, draft_greedy);
    for (int k = 0; k < 3; ++k) ++got[k][out[size_t(k)]];
  }
  EXPECT_GT(st.accepted, st.drafted / 20);
  EXPECT_LT(st.accepted, st.drafted);
  for (int k = 0; k < 3; ++k) {
    auto [s, df] = chi2(want[k], got[k]);
    ASSERT_GE(df, 1) << "token " << k;
    EXPECT_LT(s, chi2_critical(df)) << "token " << k << ": chi-square " << s << " with " << df << " degrees of freedom";
  }
}

}  // namespace

namespace {

// The trained coder-mini head against the torch reference of its forward
// (scripts/train_mtp_head.py, run by gpu-tasks/mtp.sh): the head's logits
// after each prefix of a held-out text (first draft step), and a second step
// from its own output. Needs models/coder-mini/model/mtp.safetensors and
// tests/fixtures/mtp/coder-mini-reference.safetensors, which that run makes.
TEST(Mtp, CoderMiniHeadMatchesTorchReference) {
  const std::string ref = fixture_dir("mtp") + "/coder-mini-reference.safetensors";
  const std::string model_dir = source_path("models/coder-mini/model");
  if (!std::filesystem::exists(ref) || !std::filesystem::exists(model_dir + "/mtp.safetensors"))
    GTEST_SKIP() << "no trained coder-mini head yet (gpu-tasks/mtp.sh makes it)";
  auto model = QwenModel::load(model_dir);
  ASSERT_TRUE(model->plan().mtp.has_value());
  const Backend& b = cpu_of(*model);
  const int64_t V = b.config().vocab_size;
  RefTensor ids = load_ref(ref, "ids"), want = load_ref(ref, "mtp_logits");
  const int64_t step2_at = load_ref(ref, "step2_at").ids.at(0);
  const int32_t step2_token = load_ref(ref, "step2_token").ids.at(0);
  RefTensor step2 = load_ref(ref, "step2_logits");
  ThreadPool pool(2);
  Session s(b, {}, pool, true);
  int64_t checked = 0;
  for (int64_t p = 1; p + 1 < int64_t(ids.ids.size()); ++p) {
    s.feed({ids.ids[size_t(p - 1)]});
    // Entry p-1 reads token p: its logits are the head's first draft after
    // the prefix [0, p) when p is the token chosen next.
    std::vector<std::vector<float>> got;
    const int64_t steps = p == step2_at ? 2 : 1;
    s.draft(ids.ids[size_t(p)], steps, [&](const float* l, int64_t k) {
      got.emplace_back(l, l + V);
      return k == 0 ? step2_token : 0;
    });
    EXPECT_LE(max_abs_diff(got[0].data(), want.f32.data() + (p - 1) * V, size_t(V)), 1e-3f) << "entry " << p - 1;
    if (steps == 2) {
      EXPECT_LE(max_abs_diff(got[1].data(), step2.f32.data(), size_t(V)), 1e-3f) << "second step";
    }
    ++checked;
  }
  EXPECT_GT(checked, 32);
}

}  // namespace

namespace {

// generate() (run, chat, serve) with --mtp against plain decoding, each way
// the loop can end: the same ids, finish reason and text, and the session
// left holding the same tokens. The drafts are the plain output's tokens
// except every fourth, so rounds keep several drafts and the loop ends in
// the middle of a round (the session rolled back to where it stopped).
TEST(Mtp, GenerateEndsLikePlainDecoding) {
  MtpModel m("tiny-qwen35moe");
  const Backend& b = cpu_of(*m.model);
  // coder-mini's tokenizer: the tiny model's ids (< 512) are valid in it.
  const Tokenizer tok = Tokenizer::load(source_path("models/coder-mini/tokenizer.json"));
  ThreadPool pool(2);
  GenerateOptions base;
  base.max_new_tokens = 24;
  base.sampling.temperature = 0;
  std::vector<int32_t> full;
  {
    Session s(b, {}, pool);
    full = generate(s, tok, kPrompt, base, [](const std::string&) { return true; }).ids;
  }
  ASSERT_EQ(full.size(), 24u);
  struct Case {
    const char* name;
    GenerateOptions o;
    int cancel_after = -1;  // on_text returns false on this call
  };
  std::vector<Case> cases;
  cases.push_back({"length", base});
  GenerateOptions eos = base;
  eos.sampling.eos_ids = {full[9]};
  cases.push_back({"eos", eos});
  GenerateOptions ctx = base;
  ctx.context_limit = int64_t(kPrompt.size()) + 11;
  cases.push_back({"context", ctx});
  GenerateOptions pen = base;
  pen.sampling.repetition_penalty = 1.3f;
  cases.push_back({"penalty", pen});
  cases.push_back({"cancel", base, 6});
  for (Case& c : cases) {
    auto run = [&](bool spec, int draft) {
      Session s(b, {}, pool, spec);
      GenerateOptions o = c.o;
      if (spec) {
        o.spec_draft = draft;
        o.draft_override = [&](int64_t pos, int64_t, int32_t) {
          const size_t i = size_t(pos - int64_t(kPrompt.size()));
          return i < full.size() && pos % 4 != 0 ? full[i] : 0;
        };
      }
      int calls = 0;
      GenerateResult r = generate(s, tok, kPrompt, o, [&](const std::string&) { return ++calls != c.cancel_after; });
      return std::make_tuple(r, s.tokens(), s.position());
    };
    auto [want, want_tokens, want_pos] = run(false, 0);
    for (int draft = 1; draft <= 4; ++draft) {
      auto [got, got_tokens, got_pos] = run(true, draft);
      EXPECT_EQ(got.ids, want.ids) << c.name << " draft " << draft;
      EXPECT_EQ(got.text, want.text) << c.name << " draft " << draft;
      EXPECT_EQ(got.finish_reason, want.finish_reason) << c.name << " draft " << draft;
      EXPECT_EQ(got_tokens, want_tokens) << c.name << " draft " << draft;
      EXPECT_EQ(got_pos, want_pos) << c.name << " draft " << draft;
      EXPECT_GT(got.spec.accepted, 0) << c.name << " draft " << draft;
    }
  }
}

}  // namespace

namespace {

TEST(Mtp, CommandLineErrors) {
  const std::string m = " -m " + fixture_dir("tiny-qwen35moe") + "/model";
  CmdResult r = run_flashmoe("generate" + m + " --ids 1,2 -n 4 --mtp");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--mtp: the model has no MTP head"), std::string::npos) << r.err;
  r = run_flashmoe("generate" + m + " --ids 1,2 -n 4 --spec-draft 2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--spec-draft needs --mtp"), std::string::npos) << r.err;
}

}  // namespace

namespace {

TEST(Mtp, MetricsCountSpeculation) {
  server::Metrics m;
  m.count_speculation(3, 6, 4);
  m.count_speculation(1, 2, 2);
  const std::string t = m.render({});
  EXPECT_NE(t.find("flashmoe_spec_passes_total 4\n"), std::string::npos) << t;
  EXPECT_NE(t.find("flashmoe_spec_drafted_tokens_total 8\n"), std::string::npos) << t;
  EXPECT_NE(t.find("flashmoe_spec_accepted_tokens_total 6\n"), std::string::npos) << t;
}

}  // namespace

namespace {

// flashmoe run --mtp prints what plain decoding prints (greedy, with a
// context limit, and sampled with a seed it differs only in the draws, so
// greedy only), and the mtp: statistics line.
TEST(Mtp, RunCommandMatchesPlain) {
  MtpModel m("tiny-qwen35moe");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    std::filesystem::create_symlink(source_path(std::string("models/coder-mini/") + f), m.dir.path + "/" + f);
  for (const std::string extra : {"-n 20", "-n 40 -c 30", "-n 20 --repeat-penalty 1.3"}) {
    const std::string cmd = "run -m " + m.dir.path + " -t 2 -p 'q@z~k!' --temp 0 " + extra;
    CmdResult plain = run_flashmoe(cmd);
    ASSERT_EQ(plain.code, 0) << plain.err;
    for (int d : {1, 3}) {
      CmdResult spec = run_flashmoe(cmd + " --mtp --spec-draft " + std::to_string(d));
      ASSERT_EQ(spec.code, 0) << spec.err;
      EXPECT_EQ(spec.out, plain.out) << extra << " draft " << d;
      EXPECT_NE(spec.err.find("mtp: "), std::string::npos) << spec.err;
    }
  }
}

}  // namespace

}  // namespace mtp_test
