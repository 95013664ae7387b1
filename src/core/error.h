// Error types shared by every part of deepserve.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ds {

// Any failure that reaches a user: bad input, a missing file, an unsupported op.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A malformed model file. The message names the file, the byte offset and the problem.
class FormatError : public Error {
 public:
  FormatError(const std::string& file, uint64_t offset, const std::string& problem)
      : Error(file + ": at offset " + std::to_string(offset) + ": " + problem),
        file_(file),
        offset_(offset) {}
  const std::string& file() const { return file_; }
  uint64_t offset() const { return offset_; }

 private:
  std::string file_;
  uint64_t offset_;
};

// An op or dtype the chosen backend does not implement.
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

#define DS_CHECK(cond, msg)                                                      \
  do {                                                                           \
    if (!(cond))                                                                 \
      throw ::ds::Error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                        ": check failed: " #cond ": " + (msg));                  \
  } while (0)

}  // namespace ds
