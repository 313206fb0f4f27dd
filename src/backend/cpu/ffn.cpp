// Feed-forward: a dense SwiGLU MLP, or a mixture of experts (softmax router,
// top-k, renormalised weights, plus a sigmoid-gated shared expert) whose
// routed experts come from the ExpertStore.
#include <algorithm>
#include <functional>
#include <numeric>
#include <vector>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "core/aligned.h"
#include "core/simd.h"

namespace flashmoe::cpu {

namespace {

// Tokens per claim of the per-token loops (silu * u, routing, the weighted
// sums): fewer than this many stay on the calling thread.
constexpr int64_t kTokenGrain = 16;

// g = silu(g) * u over m rows of I, row by row: the vector kernel's tail is
// scalar code, so a row's bits must not depend on how many rows share the
// call (a token batched with others gives the same result as alone).
void silu_mul_rows(float* g, const float* u, int64_t m, int64_t I) {
  for (int64_t t = 0; t < m; ++t) simd::silu_mul(g + t * I, u + t * I, I);
}

// The same over n rows spread over the threads (between the parallel
// products of a prompt chunk, so the threads do not wait on it).
void silu_mul_rows(ThreadPool& pool, float* g, const float* u, int64_t n, int64_t I) {
  pool.parallel_for(n, [&](int64_t t0, int64_t t1) { silu_mul_rows(g + t0 * I, u + t0 * I, t1 - t0, I); }, kTokenGrain);
}

// y[m, H] = down(silu(gate x) * up x) for m token rows, on the calling thread.
void swiglu_serial(const FfnExpert& e, const float* x, int64_t m, float* y, AlignedFloats& g,
                   AlignedFloats& u) {
  const int64_t H = e.gate.cols, I = e.gate.rows;
  g.resize(size_t(m * I));
  u.resize(size_t(m * I));
  matmul_serial(e.gate, x, m, H, g.data(), I);
  matmul_serial(e.up, x, m, H, u.data(), I);
  silu_mul_rows(g.data(), u.data(), m, I);
  matmul_serial(e.down, g.data(), m, I, y, H);
}

// The same over the threads: gate and up in one parallel region, the
// product silu(g) * u, then down.
void swiglu_parallel(const FfnExpert& e, const float* x, int64_t n, float* y, AlignedFloats& g, AlignedFloats& u,
                     ThreadPool& pool) {
  const int64_t I = e.gate.rows;
  g.resize(size_t(n * I));
  u.resize(size_t(n * I));
  const Product gate_up[] = {{&e.gate, g.data()}, {&e.up, u.data()}};
  matmuls(pool, gate_up, 2, x, n);
  silu_mul_rows(pool, g.data(), u.data(), n, I);
  matmul(pool, e.down, g.data(), n, y);
}

// One unit of expert work: an expert and the m tokens routed to it, the
// picks [first, first + m) of the layer's picks grouped by expert.
struct ExpertTask {
  const FfnExpert* expert;
  int64_t first, m;
  float* result;  // [m, H]: rows first .. first + m of the kept results buffer
};

}  // namespace

void dense_swiglu_ffn(const FfnExpert& e, const float* x, int64_t n, float* out, ThreadPool& pool) {
  AlignedFloats g, u;
  swiglu_parallel(e, x, n, out, g, u, pool);
}

void routed_moe_ffn(const ModelConfig& c, const FfnWeights& w, bool shared_expert, ExpertStore& store,
                    int64_t layer, const float* x, int64_t n, float* out, ThreadPool& pool) {
  const int64_t H = c.hidden_size;
  const int64_t E = c.num_experts, k = c.num_experts_per_tok;
  // Kept on this thread across calls (each element is written before it is
  // read): clearing fresh buffers of a prompt chunk was serial time between
  // the parallel loops. The names are references so that the loops' workers
  // use this thread's.
  thread_local AlignedFloats kept[5];
  AlignedFloats &probs = kept[0], &shared_g = kept[1], &shared_u = kept[2], &shared_out = kept[3],
                     &results = kept[4];
  // The routing's lists, kept the same way, the picks grouped by expert in
  // flat arrays: a token list and a weight list per expert, grown by
  // push_back, were dozens of allocations a layer at 8 tokens.
  thread_local std::vector<int64_t> kept_ids[6];
  thread_local std::vector<float> kept_weights[2];
  std::vector<int64_t> &chosen = kept_ids[0], &start = kept_ids[1], &next = kept_ids[2], &pick_token = kept_ids[3],
                       &from = kept_ids[4], &filled = kept_ids[5];
  std::vector<float> &chosen_w = kept_weights[0], &pick_weight = kept_weights[1];
  probs.resize(size_t(n * E));
  matmul(pool, w.router, x, n, probs.data());
  // Each token's top k (expert, weight), tokens spread over the threads;
  // then the picks grouped by expert, each expert's in token order, on this
  // thread.
  chosen.resize(size_t(n * k));
  chosen_w.resize(size_t(n * k));
  pool.parallel_for(n, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      float* p = probs.data() + t * E;
      softmax(p, E);
      std::iota(order.begin(), order.end(), 0);
      // Highest probability first; the lower index wins ties, as torch.topk does in practice.
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += p[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        chosen[size_t(t * k + j)] = order[j];
        chosen_w[size_t(t * k + j)] = c.norm_topk_prob ? p[order[j]] / sum : p[order[j]];
      }
    }
  }, kTokenGrain);
  // start[e]: expert e's first pick; its picks run to start[e + 1].
  start.assign(size_t(E + 1), 0);
  for (int64_t p = 0; p < n * k; ++p) ++start[size_t(chosen[size_t(p)] + 1)];
  for (int64_t e = 0; e < E; ++e) start[size_t(e + 1)] += start[size_t(e)];
  pick_token.resize(size_t(n * k));
  pick_weight.resize(size_t(n * k));
  next.assign(start.begin(), start.end() - 1);  // each expert's next free pick
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = next[size_t(chosen[size_t(t * k + j)])]++;
      pick_token[size_t(p)] = t;
      pick_weight[size_t(p)] = chosen_w[size_t(t * k + j)];
    }
  // The shared expert does not depend on the routing, so it is computed
  // (row-parallel) while a streaming store reads this layer's misses. With
  // nothing to read it is one more item beside the routed experts below
  // (its three products were three parallel regions of a few microseconds
  // each per layer; bench/NOTES.md, "Session 23"), unless it alone would be
  // more than a thread's share of the layer's expert work (many threads):
  // then it runs row-parallel before them. Either way its rows get the
  // same bits (rows_kernel's arithmetic per row does not depend on the split).
  const int64_t routed_cost = n * k * c.moe_intermediate;  // tokens x rows over every pick
  const int64_t shared_cost = shared_expert ? n * w.shared.gate.rows : 0;
  const bool shared_as_item = shared_expert && shared_cost * pool.size() <= routed_cost + shared_cost;
  if (shared_expert) shared_out.resize(size_t(n * H));
  bool shared_done = !shared_expert;
  auto run_shared_expert = [&] {
    swiglu_parallel(w.shared, x, n, shared_out.data(), shared_g, shared_u, pool);
    shared_done = true;
  };

  // One fetch per layer: a streaming store reads all its misses in parallel.
  std::vector<int32_t> ids;
  for (int64_t e = 0; e < E; ++e)
    if (start[size_t(e + 1)] > start[size_t(e)]) ids.push_back(int32_t(e));
  const std::function<void()> while_reading = shared_done ? std::function<void()>() : run_shared_expert;
  ExpertBatch batch = store.fetch(layer, ids, while_reading);
  if (!shared_done && !shared_as_item) run_shared_expert();
  // The experts' outputs side by side in one buffer of n * k rows, row p
  // for pick p (a fresh one per expert was allocated, zeroed and
  // page-faulted on every layer).
  results.resize(size_t(n * k * H));
  std::vector<ExpertTask> work;
  work.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t first = start[size_t(ids[i])], m = start[size_t(ids[i] + 1)] - first;
    work.push_back({&batch.experts[i], first, m, results.data() + first * H});
  }

  // Experts in parallel, each on one thread: with top-k >= threads this keeps
  // every core streaming weights without splitting small matrices. An
  // expert's cost grows with its tokens (times its width), which vary
  // several-fold in a prompt: the busiest go first, one per claim, so the
  // threads finish together. (Only the schedule changes: results are still
  // summed below in expert order, so the bits do not.) Item work.size() is
  // the shared expert over all n tokens when it has not run yet.
  const size_t items = work.size() + (shared_done ? 0 : 1);
  auto cost = [&](size_t i) {
    return i == work.size() ? shared_cost : work[i].m * work[i].expert->gate.rows;
  };
  std::vector<size_t> busiest(items);
  std::iota(busiest.begin(), busiest.end(), size_t(0));
  std::stable_sort(busiest.begin(), busiest.end(), [&](size_t a, size_t b) { return cost(a) > cost(b); });
  pool.parallel_for_items(int64_t(items), [&](int64_t b, int64_t e) {
    thread_local AlignedFloats xin, g, u;  // kept across layers: no page faults per call
    for (int64_t i = b; i < e; ++i) {
      if (busiest[size_t(i)] == work.size()) {
        swiglu_serial(w.shared, x, n, shared_out.data(), g, u);
        continue;
      }
      const ExpertTask& task = work[busiest[size_t(i)]];
      const int64_t m = task.m;
      const int64_t* tokens = pick_token.data() + task.first;
      xin.resize(size_t(m * H));
      for (int64_t j = 0; j < m; ++j) std::copy(x + tokens[j] * H, x + (tokens[j] + 1) * H, xin.data() + j * H);
      swiglu_serial(*task.expert, xin.data(), m, task.result, g, u);
    }
  });
  // Each token's sum, tokens spread over the threads: its experts' rows in
  // expert order (the picks are grouped by ascending expert id), then the
  // gated shared expert, so a token's bits do not depend on the split or on
  // the other tokens of the step. from[t * k + c]: token t's c-th pick.
  from.resize(size_t(n * k));
  filled.assign(size_t(n), 0);
  for (int64_t p = 0; p < n * k; ++p) {
    const int64_t t = pick_token[size_t(p)];
    from[size_t(t * k + filled[size_t(t)]++)] = p;
  }
  pool.parallel_for(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * H;
      std::fill(o, o + H, 0.0f);
      for (int64_t c = 0; c < k; ++c) {
        const int64_t p = from[size_t(t * k + c)];
        simd::axpy(pick_weight[size_t(p)], results.data() + p * H, o, H);
      }
      if (shared_expert) {
        const float gate = sigmoid(simd_dot_row(w.shared_gate, 0, x + t * H));
        simd::axpy(gate, shared_out.data() + t * H, o, H);
      }
    }
  }, kTokenGrain);
}

}  // namespace flashmoe::cpu
