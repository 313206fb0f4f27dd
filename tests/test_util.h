// Helpers shared by the tests: fixture paths, reference tensors, running the
// real flashmoe binary, scratch directories.
#pragma once
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/matrix.h"
#include "model/qwen_model.h"
#include "runtime/backend.h"
#include "runtime/device.h"

namespace flashmoe {
class CudaModel;
class CudaBackend;
}

// Skips a CUDA test, with the reason, where no usable GPU is present (CI).
#define REQUIRE_GPU()                                                                        \
  do {                                                                                       \
    const ::flashmoe::Obstacle gpu_ = ::flashmoe::gpu_presence();                            \
    if (gpu_) GTEST_SKIP() << "no GPU: " << gpu_.message;                                    \
  } while (0)

namespace flashmoe::test {

// The CPU backend over a loaded model (borrowed: the model must outlive the
// sessions that use it). One per model, kept for the test program's life.
const Backend& cpu_of(const QwenModel& m);
// The model uploaded to GPU 0 (borrowed likewise).
std::unique_ptr<Backend> gpu_of(const QwenModel& m, const GpuOptions& o = {});
// A Backend over a model the test uploaded itself (tests of the CUDA backend
// that reach its own API), both borrowed; one per pair, kept like cpu_of's.
const Backend& gpu_view(const QwenModel& m, CudaModel& device);
// The same, a backend of the test's own (both borrowed), so that a test can
// change its settings (the snapshot VRAM budget) without touching gpu_view's.
std::unique_ptr<CudaBackend> own_gpu_backend(const QwenModel& m, CudaModel& device);

std::string source_path(const std::string& rel);  // FLASHMOE_SOURCE_DIR/rel
// True in `make test-asan` (FLASHMOE_SANITIZER set), where code runs several
// times slower: long tests run a shorter version of the same checks there
// (the Release run keeps the full length).
bool sanitizer_build();
std::string fixture_dir(const std::string& name);  // tests/fixtures/<name>

struct RefTensor {
  std::vector<int64_t> shape;
  std::vector<float> f32;    // F32 tensors
  std::vector<int32_t> ids;  // I64 tensors, narrowed
};
RefTensor load_ref(const std::string& file, const std::string& name);
bool ref_has(const std::string& file, const std::string& name);

float max_abs_diff(const float* a, const float* b, size_t n);
// Mean over rows (V logits each) of KL(softmax(ref) || softmax(got)).
double mean_kl(const std::vector<float>& ref, const std::vector<float>& got, int64_t V);
float mean_abs_diff(const float* a, const float* b, size_t n);

struct CmdResult {
  int code = -1;
  std::string out, err;
};
// Runs FLASHMOE_BINARY with the given argument string (shell-quoted by the caller).
CmdResult run_flashmoe(const std::string& args, const std::string& stdin_text = "");

// Sets (or with nullptr unsets) an environment variable for the scope, for
// the processes run_flashmoe starts; restores the old value afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const std::string& name, const char* value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// A fresh directory under /tmp, removed (recursively) by the destructor.
struct TempDir {
  TempDir();
  ~TempDir();
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};
void copy_file(const std::string& from, const std::string& to);
void write_file(const std::string& path, const std::string& data);
std::string read_file(const std::string& path);
// The Python that has Debian's python3-numpy (scripts/install-deps.sh):
// /usr/bin/python3 where present (a pyenv or venv python3 earlier on PATH
// may lack it), else python3.
std::string debian_python();

std::string join_ids(const std::vector<int32_t>& ids);

// Random GGUF blocks of kind q for a rows x cols matrix, their f16 scales
// finite and moderate (within +-0.05), so products stay finite.
std::vector<uint8_t> random_quant_blocks(QuantKind q, int64_t rows, int64_t cols, std::mt19937& rng);
// A rows x cols matrix of kind q over data (borrowed: it must outlive the matrix).
Matrix quant_matrix(QuantKind q, const std::vector<uint8_t>& data, int64_t rows, int64_t cols);

// Attention's softmax weights, naively in double (the reference the KV
// caches' attend is checked against): query head q (hd floats) against
// rows 0..n-1 of keys at key head kvh (hd floats at kvh * hd), scaled.
std::vector<double> naive_softmax_weights(const float* q, const std::vector<std::vector<float>>& keys, int64_t kvh,
                                          int64_t hd, int64_t n, double scale);

// The 35B's shapes (bf16, 256 experts, head_dim 256, key dim 128) in 4
// layers of the synthetic preset (3 GatedDeltaNet, 1 attention): the CUDA
// tests' stand-in for the synthetic bench model.
ModelConfig config_35b_4_layers();

}  // namespace flashmoe::test
