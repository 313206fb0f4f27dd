#include "experts/expert_layout.h"

#include "core/error.h"

namespace flashmoe {

namespace {

// Sub-parts start 64-byte aligned: a cache line, and any SIMD load width.
ExpertPart place(int64_t rows, int64_t cols, QuantKind q, int32_t group, int32_t block_rows, uint64_t* at) {
  ExpertPart p;
  p.rows = rows;
  p.cols = cols;
  p.offset = align_up(*at, 64);
  p.bytes = q == QuantKind::None ? uint64_t(rows * cols) * 2 : uint64_t(rows * cols) * quant_bits(q) / 8;
  *at = p.offset + p.bytes;
  if (q == QuantKind::Fp8Block) {
    p.scales = align_up(*at, 64);
    *at = p.scales + uint64_t((rows + block_rows - 1) / block_rows) * uint64_t((cols + group - 1) / group) * 4;
  } else if (q != QuantKind::None) {
    const uint64_t sb = uint64_t(rows * (cols / group)) * 2;
    p.scales = align_up(*at, 64);
    p.biases = align_up(p.scales + sb, 64);
    *at = p.biases + sb;
  }
  return p;
}

Matrix view(const ExpertPart& p, const ExpertLayout& l, const uint8_t* base) {
  Matrix m;
  m.rows = p.rows;
  m.cols = p.cols;
  m.data = base + p.offset;
  if (l.quant == QuantKind::None) {
    m.dtype = DType::BF16;
  } else if (l.quant == QuantKind::Fp8Block) {
    m.dtype = DType::U8;
    m.quant = l.quant;
    m.group = l.group;
    m.block_rows = l.block_rows;
    m.block_scales = reinterpret_cast<const float*>(base + p.scales);
  } else {
    m.dtype = DType::U8;
    m.quant = l.quant;
    m.group = l.group;
    m.scales = reinterpret_cast<const uint16_t*>(base + p.scales);
    m.biases = reinterpret_cast<const uint16_t*>(base + p.biases);
  }
  return m;
}

}  // namespace

ExpertLayout ExpertLayout::make(int64_t H, int64_t I, QuantKind quant, int32_t group, int32_t block_rows) {
  ExpertLayout l;
  l.quant = quant;
  if (quant == QuantKind::Fp8Block) {
    if (group <= 0 || block_rows <= 0)
      fail("fp8 experts need a positive block size, not [" + std::to_string(block_rows) + ", " + std::to_string(group) + "]");
    l.group = group;
    l.block_rows = block_rows;
  } else if (quant != QuantKind::None) {
    if (group <= 0 || group % 8 != 0 || H % group != 0 || I % group != 0)
      fail("--group " + std::to_string(group) + " must be a multiple of 8 dividing the hidden size " +
           std::to_string(H) + " and the expert size " + std::to_string(I));
    l.group = group;
  }
  uint64_t at = 0;
  l.gate = place(I, H, quant, group, block_rows, &at);
  l.up = place(I, H, quant, group, block_rows, &at);
  l.down = place(H, I, quant, group, block_rows, &at);
  l.bytes = at;
  return l;
}

FfnExpert ExpertLayout::views(const uint8_t* base) const {
  return FfnExpert{view(gate, *this, base), view(up, *this, base), view(down, *this, base)};
}

std::string ExpertLayout::format_name() const { return quant == QuantKind::None ? "bf16" : quant_name(quant); }

QuantKind parse_expert_format(const std::string& s, const std::string& what) {
  if (s == "bf16") return QuantKind::None;
  if (s == "q8") return QuantKind::Q8;
  if (s == "q4") return QuantKind::Q4;
  if (s == "fp8") return QuantKind::Fp8Block;
  fail(what + ": unknown expert format '" + s + "' (expected bf16, q8, q4 or fp8)");
}

}  // namespace flashmoe
