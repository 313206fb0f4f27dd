// The CPU forward pass gives the same bits at any thread count. A prompt
// chunk spreads its products and its per-row work (norms, residual adds,
// routing, the experts' weighted sums, the conv's channel blocks, the
// delta rule's heads) over the threads, so no row's arithmetic may depend on
// how the rows were split; 3 threads on this 2-core machine also take the
// pool's oversubscribed (yielding) path.
#include <gtest/gtest.h>

#include <cstring>

#include "test_util.h"

namespace cpu_threads_test {

using namespace flashmoe;
using namespace flashmoe::test;

TEST(CpuThreads, PromptAndDecodeLogitsBitIdenticalAtOneTwoAndThreeThreads) {
  const std::string dir = source_path("models/coder-mini");
  auto model = QwenModel::load(dir + "/model");
  const Backend& b = cpu_of(*model);
  const RefTensor ref = load_ref(dir + "/reference.safetensors", "ids");
  // Two prompt chunks (256 + 44 rows); under the sanitizers one of 40 rows
  // (still more than one claim of every per-row loop).
  const int64_t n = sanitizer_build() ? 40 : 300;
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(ref.ids[size_t(i) % ref.ids.size()]);
  const int64_t V = model->config().vocab_size;

  std::vector<float> want_prompt, want_decode;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    auto st = b.new_state(KvConfig{});
    std::vector<float> prompt(size_t(n * V)), decode(static_cast<size_t>(V));
    b.forward(*st, ids.data(), n, LogitsMode::All, prompt.data(), pool);
    const int32_t next = ids[0];
    b.forward(*st, &next, 1, LogitsMode::Last, decode.data(), pool);
    if (threads == 1) {
      want_prompt = prompt;
      want_decode = decode;
      continue;
    }
    EXPECT_EQ(std::memcmp(prompt.data(), want_prompt.data(), prompt.size() * sizeof(float)), 0)
        << "prompt logits at " << threads << " threads differ from 1 thread (max |diff| "
        << max_abs_diff(prompt.data(), want_prompt.data(), prompt.size()) << ")";
    EXPECT_EQ(std::memcmp(decode.data(), want_decode.data(), decode.size() * sizeof(float)), 0)
        << "decode logits at " << threads << " threads differ from 1 thread";
  }
}

}  // namespace cpu_threads_test
