// Shared helpers of the experts_* tests: unique temp dirs and running a model.
#pragma once
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "engine/session.h"
#include "format/safetensors.h"
#include "model/qwen_model.h"
#include "test_util.h"

namespace flashmoe::testing {

inline std::string source_path(const std::string& rel) { return std::string(FLASHMOE_SOURCE_DIR) + "/" + rel; }

// A fresh directory under /tmp, removed (recursively) on destruction.
class TempDir {
 public:
  TempDir() {
    char t[] = "/tmp/flashmoe-test-XXXXXX";
    path_ = ::mkdtemp(t);
  }
  ~TempDir() { remove(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

  static void remove(const std::string& p) {
    if (DIR* d = ::opendir(p.c_str())) {
      while (dirent* e = ::readdir(d)) {
        std::string n = e->d_name;
        if (n == "." || n == "..") continue;
        struct stat st;
        std::string c = p + "/" + n;
        if (::lstat(c.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove(c);
        else ::unlink(c.c_str());
      }
      ::closedir(d);
    }
    ::rmdir(p.c_str());
  }

 private:
  std::string path_;
};

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
  Session s(test::cpu_of(*model), KvConfig{}, pool);
  return s.feed_all(ids);
}

}  // namespace flashmoe::testing
