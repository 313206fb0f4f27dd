#include "runtime/backend.h"

#include "core/error.h"

namespace flashmoe {

void Backend::forward_capturing(State&, const int32_t*, int64_t, LogitsMode, float*, ThreadPool&,
                                std::vector<std::vector<float>>*) const {
  fail(std::string("per-layer hidden states are only available on the CPU (this model runs on ") + label() + ")");
}

std::unique_ptr<State> Backend::new_drafting_state(const KvConfig&) const {
  fail(std::string("--mtp: speculative decoding with the MTP head runs only on the CPU so far (this model runs on ") +
       label() + ")");
}

void Backend::draft(State&, int32_t, int64_t, const DraftPicker&, int32_t*, ThreadPool&) const {
  fail(std::string("--mtp: speculative decoding with the MTP head runs only on the CPU so far (this model runs on ") +
       label() + ")");
}

void Backend::forward_batch(const BatchItem* items, int64_t count, ThreadPool& pool) const {
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j = 0; j < i; ++j)
      if (items[j].state == items[i].state) fail("forward_batch: one state appears twice in a batch");
  }
  for (int64_t i = 0; i < count; ++i)
    forward(*items[i].state, items[i].ids, items[i].n, items[i].mode, items[i].logits, pool);
}

}  // namespace flashmoe
