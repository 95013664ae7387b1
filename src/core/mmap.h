// Read-only memory-mapped files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>

namespace ds {

class MappedFile {
 public:
  // Maps the whole file read-only; throws ds::Error naming the path on failure.
  static std::shared_ptr<MappedFile> open(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }
  // Touches every page with `threads` threads so later reads do not fault; calls
  // progress(done_bytes, total_bytes) as it goes.
  void prefetch(int threads, const std::function<void(size_t, size_t)>& progress = {}) const;

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace ds
