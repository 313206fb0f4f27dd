#include "tokenizer/normalizer.h"

#include <utf8proc.h>

#include <cstdlib>

#include "core/error.h"

namespace flashmoe {

std::string normalize(std::string_view text, NormalForm form) {
  if (form == NormalForm::None || text.empty()) return std::string(text);
  bool ascii = true;
  for (unsigned char c : text) {
    if (c >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(text);
  int opts = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::NFC: opts |= UTF8PROC_COMPOSE; break;
    case NormalForm::NFD: opts |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::NFKC: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::NFKD: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::None: break;
  }
  // An explicit length (no UTF8PROC_NULLTERM) keeps embedded NULs intact.
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          utf8proc_ssize_t(text.size()), &dst, utf8proc_option_t(opts));
  if (n < 0) fail(std::string("unicode normalisation failed: ") + utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(dst), size_t(n));
  std::free(dst);
  return out;
}

}  // namespace flashmoe
