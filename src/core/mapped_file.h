// A read-only memory mapping of a whole file. Weights stay in the page cache
// and are read in place; nothing is copied at load time.
//
// If a mapped file is truncated under the running process (or its storage
// fails), touching a page that is gone raises SIGBUS. The first mapping
// installs a SIGBUS handler that, for an address inside a live mapping,
// prints "flashmoe: error: <file>: the file became unreadable while in use
// ..." and exits with status 1; any other SIGBUS goes to the previous handler
// (e.g. a sanitizer's) or the default action.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace flashmoe {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws Error naming the file
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int guard_ = -1;  // slot in the SIGBUS handler's table of mappings
};

bool file_exists(const std::string& path);
bool is_directory(const std::string& path);
std::string read_text_file(const std::string& path);  // throws Error naming the file

}  // namespace flashmoe
