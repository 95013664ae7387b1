// safetensors reader: single files and sharded checkpoints (model.safetensors.index.json).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mmap.h"
#include "core/tensor.h"

namespace ds {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // row-major, as written
  uint64_t offset = 0;         // absolute byte offset in the file
  uint64_t nbytes = 0;
};

class SafetensorsFile {
 public:
  // Maps and parses; throws FormatError (file, offset, problem) when malformed: bad header
  // length, invalid JSON, unknown dtype, shape/size mismatch, out-of-bounds or
  // overlapping data ranges.
  static SafetensorsFile open(const std::filesystem::path& path);
  static SafetensorsFile parse(std::span<const uint8_t> bytes, const std::string& name);

  const std::string& path() const { return name_; }
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Row-major view; a scalar (shape []) is shown as [1]. Throws UnsupportedError above rank 4.
  // The format does not align data: the pointer is aligned only if the writer padded it.
  TensorView view(const SafetensorsTensor& t) const;
  const std::shared_ptr<MappedFile>& mapping() const { return file_; }

 private:
  std::string name_;
  std::shared_ptr<MappedFile> file_;
  std::span<const uint8_t> bytes_;
  std::vector<SafetensorsTensor> tensors_;  // in data order
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint folder: model.safetensors, or the shards listed by
// model.safetensors.index.json (each shard checked to hold the tensors the index names).
class SafetensorsCheckpoint {
 public:
  static SafetensorsCheckpoint open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  std::vector<std::string> tensor_names() const;  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // Throws Error naming the tensor and the checkpoint when absent.
  const SafetensorsTensor& tensor(const std::string& name) const;
  TensorView view(const std::string& name) const;
  const std::vector<SafetensorsFile>& shards() const { return shards_; }
  uint64_t total_bytes() const;

 private:
  std::filesystem::path dir_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, std::pair<size_t, size_t>> where_;  // name -> (shard, tensor index)
};

}  // namespace ds
