#include "server/slots.h"

#include <algorithm>

namespace flashmoe::server {

SlotPool::SlotPool(int slots, int queue)
    : busy_(size_t(std::max(slots, 1)), false), bytes_(busy_.size(), {0, 0}), queue_limit_(std::max(queue, 0)) {}

std::unique_ptr<SlotPool::Lease> SlotPool::acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  auto free_slot = [&] { return int(std::find(busy_.begin(), busy_.end(), false) - busy_.begin()); };
  if (stopping_) return nullptr;
  int i = free_slot();
  if (i == int(busy_.size())) {
    if (waiting_ >= queue_limit_) return nullptr;
    ++waiting_;
    cv_.wait(lock, [&] { return stopping_ || free_slot() < int(busy_.size()); });
    --waiting_;
    if (stopping_) return nullptr;
    i = free_slot();
  }
  busy_[size_t(i)] = true;
  return std::make_unique<Lease>(*this, i);
}

SlotPool::Lease::~Lease() {
  {
    std::lock_guard<std::mutex> lock(pool_.mu_);
    pool_.busy_[size_t(index_)] = false;
    pool_.bytes_[size_t(index_)] = {0, 0};
  }
  pool_.cv_.notify_one();
}

void SlotPool::Lease::report(int64_t kv_bytes, int64_t recurrent_bytes) {
  std::lock_guard<std::mutex> lock(pool_.mu_);
  pool_.bytes_[size_t(index_)] = {kv_bytes, recurrent_bytes};
}

void SlotPool::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

int SlotPool::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int(std::count(busy_.begin(), busy_.end(), true));
}

int SlotPool::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

void SlotPool::state_bytes(int64_t* kv, int64_t* recurrent) const {
  std::lock_guard<std::mutex> lock(mu_);
  *kv = *recurrent = 0;
  for (const auto& [k, r] : bytes_) {
    *kv += k;
    *recurrent += r;
  }
}

}  // namespace flashmoe::server
