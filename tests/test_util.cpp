#include "test_util.h"

#include <map>
#include <mutex>

#include "kv/presets.h"
#include "runtime/cpu_backend.h"
#include "runtime/cuda_backend.h"
#include "runtime/cuda_backend_impl.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "core/block_quant.h"
#include "core/dtype.h"
#include "format/safetensors.h"

namespace flashmoe::test {

namespace {
// A shared_ptr that does not own: the tests keep their models themselves.
std::shared_ptr<const QwenModel> borrow(const QwenModel& m) { return {std::shared_ptr<const QwenModel>(), &m}; }
}  // namespace

const Backend& cpu_of(const QwenModel& m) {
  // A CpuBackend holds nothing but the model's address, so a backend kept for
  // an address also serves a later model loaded at the same address.
  static std::mutex mu;
  static std::map<const QwenModel*, std::unique_ptr<Backend>> backends;
  std::lock_guard<std::mutex> lock(mu);
  auto& b = backends[&m];
  if (!b) b = std::make_unique<CpuBackend>(borrow(m));
  return *b;
}

const Backend& gpu_view(const QwenModel& m, CudaModel& device) {
  static std::mutex mu;
  static std::map<std::pair<const QwenModel*, CudaModel*>, std::unique_ptr<Backend>> backends;
  std::lock_guard<std::mutex> lock(mu);
  auto& b = backends[{&m, &device}];
  if (!b) b = own_gpu_backend(m, device);
  return *b;
}

std::unique_ptr<CudaBackend> own_gpu_backend(const QwenModel& m, CudaModel& device) {
  return std::make_unique<CudaBackend>(borrow(m), std::shared_ptr<CudaModel>(std::shared_ptr<CudaModel>(), &device));
}

std::unique_ptr<Backend> gpu_of(const QwenModel& m, const GpuOptions& o) { return make_cuda_backend(borrow(m), o); }

namespace {
// The flashmoe processes the tests start run on the CPU unless a test says
// otherwise (the CUDA tests pass --device), so that the suite gives the same
// results on a GPU machine, where the default (auto) would pick the GPU.
// ctest sets the same (CMakeLists.txt); this covers running flashmoe_tests
// directly. Not overwritten: FLASHMOE_DEVICE=auto ./flashmoe_tests is allowed.
[[maybe_unused]] const bool device_pinned = [] { return ::setenv("FLASHMOE_DEVICE", "cpu", /*overwrite=*/0) == 0; }();
}  // namespace

ScopedEnv::ScopedEnv(const std::string& name, const char* value) : name_(name) {
  if (const char* old = std::getenv(name.c_str())) old_ = old;
  if (value) ::setenv(name.c_str(), value, 1);
  else ::unsetenv(name.c_str());
}

ScopedEnv::~ScopedEnv() {
  if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
  else ::unsetenv(name_.c_str());
}

std::string source_path(const std::string& rel) { return std::string(FLASHMOE_SOURCE_DIR) + "/" + rel; }
std::string fixture_dir(const std::string& name) { return source_path("tests/fixtures/" + name); }
bool sanitizer_build() { return std::getenv("FLASHMOE_SANITIZER") != nullptr; }

bool ref_has(const std::string& file, const std::string& name) { return SafetensorsFile(file).has(name); }

RefTensor load_ref(const std::string& file, const std::string& name) {
  SafetensorsFile f(file);
  TensorView t = f.get(name);
  RefTensor r;
  r.shape = t.shape;
  if (t.dtype == DType::F32) {
    const float* p = reinterpret_cast<const float*>(t.data);
    r.f32.assign(p, p + t.numel());
  } else if (t.dtype == DType::I64) {
    const int64_t* p = reinterpret_cast<const int64_t*>(t.data);
    for (int64_t i = 0; i < t.numel(); ++i) r.ids.push_back(int32_t(p[i]));
  } else {
    throw std::runtime_error("unexpected dtype in reference " + name);
  }
  return r;
}

double mean_kl(const std::vector<float>& ref, const std::vector<float>& got, int64_t V) {
  const int64_t n = int64_t(ref.size()) / V;
  double total = 0;
  for (int64_t t = 0; t < n; ++t) {
    const float* a = ref.data() + t * V;
    const float* b = got.data() + t * V;
    double ma = a[0], mb = b[0];
    for (int64_t i = 1; i < V; ++i) ma = std::max<double>(ma, a[i]), mb = std::max<double>(mb, b[i]);
    double za = 0, zb = 0;
    for (int64_t i = 0; i < V; ++i) za += std::exp(a[i] - ma), zb += std::exp(b[i] - mb);
    double kl = 0;
    for (int64_t i = 0; i < V; ++i) {
      const double la = a[i] - ma - std::log(za), lb = b[i] - mb - std::log(zb);
      kl += std::exp(la) * (la - lb);
    }
    total += kl;
  }
  return total / double(n);
}

float max_abs_diff(const float* a, const float* b, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

float mean_abs_diff(const float* a, const float* b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += std::fabs(double(a[i]) - double(b[i]));
  return float(s / double(n));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out << data;
}

void copy_file(const std::string& from, const std::string& to) {
  std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
}

TempDir::TempDir() {
  char tmpl[] = "/tmp/flashmoe-test-XXXXXX";
  path = ::mkdtemp(tmpl);
}
TempDir::~TempDir() { std::filesystem::remove_all(path); }

CmdResult run_flashmoe(const std::string& args, const std::string& stdin_text) {
  TempDir d;
  std::string in = d.path + "/in", out = d.path + "/out", err = d.path + "/err";
  write_file(in, stdin_text);
  std::string cmd = std::string(FLASHMOE_BINARY) + " " + args + " <" + in + " >" + out + " 2>" + err;
  int status = std::system(cmd.c_str());
  CmdResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

std::vector<uint8_t> random_quant_blocks(QuantKind q, int64_t rows, int64_t cols, std::mt19937& rng) {
  const int64_t be = block_elems(q), bb = block_bytes(q), nb = rows * cols / be;
  std::vector<uint8_t> d(size_t(nb * bb));
  for (auto& x : d) x = uint8_t(rng());
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (int64_t k = 0; k < nb; ++k) {
    uint8_t* b = d.data() + k * bb;
    auto put = [&](size_t at) {
      const uint16_t v = f32_to_f16(u(rng));
      std::memcpy(b + at, &v, 2);
    };
    switch (q) {
      case QuantKind::Q4_1: case QuantKind::Q5_1: case QuantKind::Q4_K: case QuantKind::Q5_K:
        put(0);
        put(2);
        break;
      case QuantKind::Q6_K: put(208); break;
      default: put(0); break;
    }
  }
  return d;
}

Matrix quant_matrix(QuantKind q, const std::vector<uint8_t>& data, int64_t rows, int64_t cols) {
  Matrix W;
  W.dtype = DType::U8;
  W.quant = q;
  W.data = data.data();
  W.rows = rows;
  W.cols = cols;
  return W;
}

std::vector<double> naive_softmax_weights(const float* q, const std::vector<std::vector<float>>& keys, int64_t kvh,
                                          int64_t hd, int64_t n, double scale) {
  std::vector<double> p(static_cast<size_t>(n));
  double mx = -1e300, sum = 0;
  for (int64_t s = 0; s < n; ++s) {
    double t = 0;
    for (int64_t i = 0; i < hd; ++i) t += double(q[i]) * keys[size_t(s)][size_t(kvh * hd + i)];
    p[size_t(s)] = t * scale;
    mx = std::max(mx, p[size_t(s)]);
  }
  for (auto& x : p) sum += (x = std::exp(x - mx));
  for (auto& x : p) x /= sum;
  return p;
}

}  // namespace flashmoe::test

namespace flashmoe::test {
std::string debian_python() { return ::access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3"; }

ModelConfig config_35b_4_layers() {
  ModelConfig c = model_preset("qwen3.5-35b-a3b");
  c.num_layers = 4;
  c.layer_kinds.resize(4);
  c.layer_is_moe.resize(4);
  return c;
}

}  // namespace flashmoe::test
