// std::vector storage on 64-byte (cache line) boundaries. The prefill's
// panel kernel (core/simd.h) reads its rows and tokens in 64-byte vectors:
// when a buffer starts mid-line, every load spans two lines and the loads,
// not the multiply-adds, set the pace (30-40% slower at coder-mini's shapes,
// bench/NOTES.md "Prefill on one thread").
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace flashmoe {

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};

// A float buffer whose first element starts a cache line.
using AlignedFloats = std::vector<float, CacheLineAllocator<float>>;

}  // namespace flashmoe
