// Feed-forward: a dense SwiGLU MLP, or a mixture of experts (softmax router,
// top-k, renormalised weights, plus a sigmoid-gated shared expert) whose
// routed experts come from the ExpertStore.
#include <algorithm>
#include <numeric>
#include <vector>

#include "backend/cpu/layers.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "core/simd.h"

namespace flashmoe::cpu {

namespace {

// g = silu(g) * u over m rows of I, row by row: the vector kernel's tail is
// scalar code, so a row's bits must not depend on how many rows share the
// call (a token batched with others gives the same result as alone).
void silu_mul_rows(float* g, const float* u, int64_t m, int64_t I) {
  for (int64_t t = 0; t < m; ++t) simd::silu_mul(g + t * I, u + t * I, I);
}

// y[m, H] = down(silu(gate x) * up x) for m token rows, on the calling thread.
void swiglu_serial(const FfnExpert& e, const float* x, int64_t m, float* y, std::vector<float>& g,
                   std::vector<float>& u) {
  const int64_t H = e.gate.cols, I = e.gate.rows;
  g.resize(size_t(m * I));
  u.resize(size_t(m * I));
  matmul_serial(e.gate, x, m, H, g.data(), I);
  matmul_serial(e.up, x, m, H, u.data(), I);
  silu_mul_rows(g.data(), u.data(), m, I);
  matmul_serial(e.down, g.data(), m, I, y, H);
}

// One unit of expert work: an expert and the tokens routed to it.
struct ExpertTask {
  const FfnExpert* expert;
  std::vector<int64_t> tokens;
  std::vector<float> weights;  // per token
  std::vector<float> result;   // [tokens, H]
};

}  // namespace

void dense_swiglu_ffn(const FfnExpert& e, const float* x, int64_t n, float* out, ThreadPool& pool) {
  const int64_t I = e.gate.rows;
  std::vector<float> g(size_t(n * I)), u(size_t(n * I));
  matmul(pool, e.gate, x, n, g.data());
  matmul(pool, e.up, x, n, u.data());
  silu_mul_rows(g.data(), u.data(), n, I);
  matmul(pool, e.down, g.data(), n, out);
}

void routed_moe_ffn(const ModelConfig& c, const FfnWeights& w, bool shared_expert, ExpertStore& store,
                    int64_t layer, const float* x, int64_t n, float* out, ThreadPool& pool) {
  const int64_t H = c.hidden_size;
  const int64_t E = c.num_experts, k = c.num_experts_per_tok;
  std::vector<float> probs(size_t(n * E));
  matmul(pool, w.router, x, n, probs.data());
  std::vector<ExpertTask> tasks(static_cast<size_t>(E));
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < n; ++t) {
    float* p = probs.data() + t * E;
    softmax(p, E);
    std::iota(order.begin(), order.end(), 0);
    // Highest probability first; the lower index wins ties, as torch.topk does in practice.
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += p[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      ExpertTask& task = tasks[order[j]];
      task.tokens.push_back(t);
      task.weights.push_back(c.norm_topk_prob ? p[order[j]] / sum : p[order[j]]);
    }
  }
  // The shared expert does not depend on the routing, so it is computed
  // (row-parallel) while a streaming store reads this layer's misses.
  std::vector<float> shared_out, shared_w;
  auto run_shared_expert = [&] {
    if (!shared_expert) return;
    const FfnExpert& e = w.shared;
    const int64_t I = e.gate.rows;
    std::vector<float> g(size_t(n * I)), u(size_t(n * I));
    matmul(pool, e.gate, x, n, g.data());
    matmul(pool, e.up, x, n, u.data());
    silu_mul_rows(g.data(), u.data(), n, I);
    shared_out.resize(size_t(n * H));
    matmul(pool, e.down, g.data(), n, shared_out.data());
    for (int64_t t = 0; t < n; ++t) shared_w.push_back(sigmoid(simd_dot_row(w.shared_gate, 0, x + t * H)));
  };

  // One fetch per layer: a streaming store reads all its misses in parallel.
  std::vector<int32_t> ids;
  for (int64_t e = 0; e < E; ++e)
    if (!tasks[e].tokens.empty()) ids.push_back(int32_t(e));
  ExpertBatch batch = store.fetch(layer, ids, run_shared_expert);
  std::vector<ExpertTask> work;
  for (size_t i = 0; i < ids.size(); ++i) {
    tasks[ids[i]].expert = &batch.experts[i];
    work.push_back(std::move(tasks[ids[i]]));
  }

  // Experts in parallel, each on one thread: with top-k >= threads this keeps
  // every core streaming weights without splitting small matrices. An
  // expert's cost grows with its tokens, which vary several-fold in a
  // prompt: the busiest go first, one per claim, so the threads finish
  // together. (Only the schedule changes: results are still summed below in
  // expert order, so the bits do not.)
  std::vector<size_t> busiest(work.size());
  std::iota(busiest.begin(), busiest.end(), size_t(0));
  std::stable_sort(busiest.begin(), busiest.end(),
                   [&](size_t a, size_t b) { return work[a].tokens.size() > work[b].tokens.size(); });
  pool.parallel_for_items(int64_t(work.size()), [&](int64_t b, int64_t e) {
    thread_local std::vector<float> xin, g, u;  // kept across layers: no page faults per call
    for (int64_t i = b; i < e; ++i) {
      ExpertTask& task = work[busiest[size_t(i)]];
      const int64_t m = int64_t(task.tokens.size());
      xin.resize(size_t(m * H));
      for (int64_t j = 0; j < m; ++j) std::copy(x + task.tokens[j] * H, x + (task.tokens[j] + 1) * H, xin.data() + j * H);
      task.result.resize(size_t(m * H));
      swiglu_serial(*task.expert, xin.data(), m, task.result.data(), g, u);
    }
  });
  std::fill(out, out + n * H, 0.0f);
  for (const ExpertTask& task : work)
    for (size_t j = 0; j < task.tokens.size(); ++j)
      simd::axpy(task.weights[j], task.result.data() + j * H, out + task.tokens[j] * H, H);
  if (shared_expert)
    for (int64_t t = 0; t < n; ++t) simd::axpy(shared_w[t], shared_out.data() + t * H, out + t * H, H);
}

}  // namespace flashmoe::cpu
