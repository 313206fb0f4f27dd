// safetensors header parsing: arbitrary bytes as a whole .safetensors file.
#include "core/error.h"
#include "format/safetensors.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  flashmoe::fuzz::MemFile f(data, size);
  try {
    flashmoe::SafetensorsFile st(f.path());
    for (const auto& name : st.names()) {
      try {
        flashmoe::TensorView t = st.get(name);
        // Touch the first and last byte the header promises.
        size_t n = flashmoe::dtype_size(t.dtype);
        for (int64_t d : t.shape) n *= size_t(d);
        if (n) {
          volatile uint8_t a = static_cast<const uint8_t*>(t.data)[0];
          volatile uint8_t b = static_cast<const uint8_t*>(t.data)[n - 1];
          (void)a, (void)b;
        }
      } catch (const flashmoe::Error&) {
      }
    }
  } catch (const flashmoe::Error&) {
  }
  return 0;
}
