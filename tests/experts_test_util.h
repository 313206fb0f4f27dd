// Shared helpers of the experts_* tests: reference ids and running a model.
#pragma once

#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "engine/session.h"
#include "format/safetensors.h"
#include "model/qwen_model.h"
#include "test_util.h"

namespace flashmoe::test {

inline std::vector<int32_t> reference_ids(const std::string& ref_file, const std::string& tensor, size_t max_n = 0) {
  SafetensorsFile f(ref_file);
  TensorView t = f.get(tensor);
  const int64_t* p = reinterpret_cast<const int64_t*>(t.data);
  std::vector<int32_t> ids(p, p + t.numel());
  if (max_n && ids.size() > max_n) ids.resize(max_n);
  return ids;
}

// Logits [n, V] of ids fed as one prompt.
inline std::vector<float> run_logits(const std::string& dir, const std::vector<int32_t>& ids,
                                     const ExpertOptions& opt = {}) {
  auto model = QwenModel::load(dir, opt);
  ThreadPool pool(2);
  Session s(cpu_of(*model), KvConfig{}, pool);
  return s.feed_all(ids);
}

}  // namespace flashmoe::test
