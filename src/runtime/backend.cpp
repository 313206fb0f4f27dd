#include "runtime/backend.h"

#include <algorithm>

#include "core/argmax.h"
#include "core/error.h"

namespace flashmoe {

void Backend::forward_capturing(State&, const int32_t*, int64_t, LogitsMode, float*, ThreadPool&,
                                std::vector<std::vector<float>>*) const {
  fail(std::string("per-layer hidden states are only available on the CPU (this model runs on ") + label() + ")");
}

std::unique_ptr<State> Backend::new_drafting_state(const KvConfig&) const {
  fail(std::string("--mtp: speculative decoding with the MTP head is not implemented on this backend (") + label() +
       ")");
}

void Backend::draft(State&, int32_t, int64_t, const DraftPicker&, int32_t*, ThreadPool&) const {
  fail(std::string("--mtp: speculative decoding with the MTP head is not implemented on this backend (") + label() +
       ")");
}

void Backend::forward_argmax_rows(State& st, const int32_t* ids, int64_t n, int32_t* best, ThreadPool& pool) const {
  const int64_t V = config().vocab_size;
  std::vector<float> rows(size_t(std::max<int64_t>(n, 0) * V));
  forward(st, ids, n, LogitsMode::All, rows.data(), pool);
  for (int64_t t = 0; t < n; ++t) best[t] = argmax(rows.data() + t * V, V);
}

BatchArgmax::BatchArgmax(const BatchItem* items, int64_t count, int64_t vocab)
    : items_(items, items + std::max<int64_t>(count, 0)), vocab_(vocab) {
  size_t rows = 0;
  for (size_t i = 0; i < items_.size(); ++i) {
    const BatchItem& it = items_[i];
    if (it.argmax && it.mode != LogitsMode::Last)
      fail("forward_batch: item " + std::to_string(i) + " asks for an argmax without LogitsMode::Last");
    if (it.argmax && !it.logits) ++rows;
  }
  scratch_.resize(rows * size_t(vocab));
  size_t r = 0;
  for (BatchItem& it : items_)
    if (it.argmax && !it.logits) it.logits = scratch_.data() + r++ * size_t(vocab);
}

void BatchArgmax::finish() const {
  for (const BatchItem& it : items_)
    if (it.argmax) *it.argmax = argmax(it.logits, vocab_);
}

void Backend::forward_batch(const BatchItem* items, int64_t count, ThreadPool& pool) const {
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j = 0; j < i; ++j)
      if (items[j].state == items[i].state) fail("forward_batch: one state appears twice in a batch");
  }
  const BatchArgmax am(items, count, config().vocab_size);
  for (int64_t i = 0; i < count; ++i) {
    const BatchItem& it = am.items()[i];
    forward(*it.state, it.ids, it.n, it.mode, it.logits, pool);
  }
  am.finish();
}

}  // namespace flashmoe
