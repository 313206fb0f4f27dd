// The AVX-512 q8 / q4 row kernels behind core/matrix_rows.h (defined in
// matrix_rows_avx512.cpp; call only at CpuLevel::Avx512, for groups that
// are a multiple of 16). Internal to core/.
#pragma once
#include <cstdint>

#include "core/matrix.h"

namespace flashmoe::cpu::avx512 {

void quant_dequant_row(const Matrix& W, int64_t r, float* out);
float quant_dot_row(const Matrix& W, int64_t r, const float* x);

}  // namespace flashmoe::cpu::avx512

// The AVX512-VNNI int8 row dot (matrix_rows_vnni.cpp; call only at
// CpuLevel::Avx512Vnni, for groups that are a multiple of 32).
namespace flashmoe::cpu::vnni {

float quant_dot_row_int8(const Matrix& W, int64_t r, const int8_t* code, const float* scale, const float* sum);

}  // namespace flashmoe::cpu::vnni
