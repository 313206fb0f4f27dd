#include "experts/streaming_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <latch>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/xxhash64.h"
#include "experts/expert_cache.h"

namespace flashmoe {

namespace {

// Recycles expert buffers. A fresh buffer of this size is mmapped by malloc
// and page-faulted in on first touch, which costs as much as the read itself
// on a VM; reusing buffers keeps a miss at one pread. At most `max_free`
// idle buffers are kept (a layer's worth), so this adds no more than the
// working set that --max-memory already reserves.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  BufferPool(size_t len, size_t max_free) : len_(len), max_free_(max_free) {}
  ~BufferPool() {
    for (void* p : free_) std::free(p);
  }
  std::shared_ptr<const void> get() {
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_.empty()) p = free_.back(), free_.pop_back();
    }
    if (!p) p = std::aligned_alloc(kExpertAlign, len_);
    if (!p) throw std::bad_alloc();
    auto self = shared_from_this();
    return std::shared_ptr<const void>(p, [self](const void* q) { self->put(const_cast<void*>(q)); });
  }

 private:
  void put(void* p) {
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.size() < max_free_) free_.push_back(p);
    else std::free(p);
  }
  size_t len_, max_free_;
  std::mutex mu_;
  std::vector<void*> free_;
};

// Threads that run submitted reads in the background, so the caller can
// compute while they are in flight (unlike ThreadPool, whose caller joins in).
class IoQueue {
 public:
  explicit IoQueue(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~IoQueue() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return int(threads_.size()); }
  void submit(std::function<void()> fn) {  // fn must not throw
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        fn = std::move(q_.front());
        q_.pop_front();
      }
      fn();
    }
  }
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false;
};

struct LayerFile {
  int fd = -1;
  bool direct = false;
};

class StreamingStore : public ExpertStore {
 public:
  StreamingStore(const PackedManifest& m, uint64_t cache_bytes, CachePolicy policy, int io_threads, bool direct)
      : m_(m),
        cache_(cache_bytes, policy),
        io_(std::max(1, io_threads)),
        policy_(policy),
        buffers_(std::make_shared<BufferPool>(align_up(m.layout.bytes, kExpertAlign),
                                              m.layers.empty() ? 0 : m.layers[0].experts.size())) {
    stats_.expert_bytes = m.layout.bytes;
    for (const auto& l : m_.layers) {
      if (size_t(l.layer) >= files_.size()) files_.resize(l.layer + 1);
      const std::string path = m_.path_of(l);
      LayerFile f;
      if (direct) {
        // Not every file system takes O_DIRECT (tmpfs does not): fall back to
        // buffered reads and drop the pages after each one.
        f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        f.direct = f.fd >= 0;
      }
      if (f.fd < 0) f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (f.fd < 0) fail("cannot open expert file " + path + ": " + std::strerror(errno));
      files_[l.layer] = f;
    }
    drop_after_read_ = direct;
  }
  ~StreamingStore() override {
    for (auto& f : files_)
      if (f.fd >= 0) ::close(f.fd);
  }

  ExpertBatch fetch(int64_t layer, const std::vector<int32_t>& ids,
                    const std::function<void()>& while_waiting) override {
    std::lock_guard<std::mutex> lk(mu_);
    const PackedLayer* pl = m_.find_layer(layer);
    ExpertBatch b;
    b.experts.resize(ids.size());
    b.pins.resize(ids.size());
    std::vector<size_t> miss;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (auto buf = cache_.get(ExpertCache::key(layer, ids[i]))) b.pins[i] = std::move(buf);
      else miss.push_back(i);
    }
    stats_.requested += ids.size();
    stats_.hits += ids.size() - miss.size();
    stats_.misses += miss.size();

    // Every miss is one read on the I/O threads; the caller's own work runs meanwhile.
    std::vector<std::string> errors(miss.size());
    std::latch done(std::ptrdiff_t(miss.size()));
    using Clock = std::chrono::steady_clock;
    const Clock::time_point submitted = Clock::now();
    std::atomic<Clock::rep> last_landed{submitted.time_since_epoch().count()};
    for (size_t j = 0; j < miss.size(); ++j)
      io_.submit([&, j] {
        try {
          b.pins[miss[j]] = read_expert(*pl, ids[miss[j]]);
        } catch (const std::exception& err) {
          errors[j] = err.what();
        }
        const Clock::rep now = Clock::now().time_since_epoch().count();
        Clock::rep seen = last_landed.load();
        while (seen < now && !last_landed.compare_exchange_weak(seen, now)) {
        }
        done.count_down();
      });
    if (while_waiting && !miss.empty()) {
      try {
        while_waiting();
      } catch (...) {
        done.wait();  // the reads write into this frame
        throw;
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    done.wait();
    stats_.io_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.read_s += std::chrono::duration<double>(Clock::duration(last_landed.load()) - submitted.time_since_epoch()).count();
    for (const auto& err : errors)
      if (!err.empty()) fail(err);
    stats_.bytes_read += miss.size() * m_.layout.bytes;
    for (size_t j : miss) cache_.put(ExpertCache::key(layer, ids[j]), b.pins[j], align_up(m_.layout.bytes, kExpertAlign));
    for (size_t i = 0; i < ids.size(); ++i) b.experts[i] = m_.layout.views(static_cast<const uint8_t*>(b.pins[i].get()));
    return b;
  }

  ExpertStats stats() const override {
    ExpertStats s = stats_;
    s.cache_bytes = cache_.bytes();
    s.cache_capacity = cache_.capacity();
    return s;
  }
  void reset_stats() override { stats_ = ExpertStats{.expert_bytes = stats_.expert_bytes}; }
  void note_tokens(int64_t n) override { stats_.tokens += n; }
  std::string describe() const override {
    return "streaming (" + m_.layout.format_name() + ", cache " + std::to_string(cache_.capacity() >> 20) + " MiB, " +
           cache_policy_name(policy_) + ", " + std::to_string(io_.size()) + " I/O threads)";
  }

 private:
  // One pread of one expert record into a fresh page-aligned buffer.
  std::shared_ptr<const void> read_expert(const PackedLayer& pl, int32_t id) const {
    const PackedExpert& e = pl.experts[id];
    const LayerFile& f = files_[pl.layer];
    const uint64_t len = align_up(e.size, kExpertAlign);  // whole pages, as O_DIRECT needs
    std::shared_ptr<const void> buf = buffers_->get();
    void* p = const_cast<void*>(buf.get());
    const std::string what = m_.path_of(pl) + ": expert " + std::to_string(id) + " of layer " + std::to_string(pl.layer);
    uint64_t got = 0;
    while (got < e.size) {
      ssize_t r = ::pread(f.fd, static_cast<uint8_t*>(p) + got, len - got, off_t(e.offset + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail("cannot read " + what + ": " + std::strerror(errno));
      if (r == 0) break;
      got += uint64_t(r);
    }
    if (got < e.size)
      fail("short read of " + what + ": got " + std::to_string(got) + " of " + std::to_string(e.size) +
           " bytes (the file is truncated; re-run flashmoe pack)");
    if (drop_after_read_ && !f.direct) ::posix_fadvise(f.fd, off_t(e.offset), off_t(len), POSIX_FADV_DONTNEED);
    if (xxhash64(p, e.size) != e.xxh64)
      fail(what + " fails its checksum: the file is corrupt (re-run flashmoe pack)");
    return buf;
  }

  PackedManifest m_;
  std::vector<LayerFile> files_;
  ExpertCache cache_;
  IoQueue io_;
  CachePolicy policy_;
  std::shared_ptr<BufferPool> buffers_;
  bool drop_after_read_ = false;
  std::mutex mu_;
  ExpertStats stats_;
};

}  // namespace

std::unique_ptr<ExpertStore> make_streaming_store(const PackedManifest& m, uint64_t cache_bytes, CachePolicy policy,
                                                  int io_threads, bool direct_io) {
  return std::make_unique<StreamingStore>(m, cache_bytes, policy, io_threads, direct_io);
}

}  // namespace flashmoe
