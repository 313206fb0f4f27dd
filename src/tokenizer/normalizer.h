// Unicode normalisation forms (tokenizer.json "normalizer"), via utf8proc.
#pragma once
#include <string>
#include <string_view>

namespace flashmoe {

enum class NormalForm { None, NFC, NFD, NFKC, NFKD };

// `text` must be valid UTF-8. All-ASCII input is returned unchanged without
// calling utf8proc (ASCII is invariant under every form).
std::string normalize(std::string_view text, NormalForm form);

}  // namespace flashmoe
