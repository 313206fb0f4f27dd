// A read-only memory mapping of a whole file. Weights stay in the page cache
// and are read in place; nothing is copied at load time.
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
};

bool file_exists(const std::string& path);
bool is_directory(const std::string& path);
std::string read_text_file(const std::string& path);  // throws Error naming the file

}  // namespace flashmoe
