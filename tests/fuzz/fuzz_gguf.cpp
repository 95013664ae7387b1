// libFuzzer target: GgufFile::parse on arbitrary bytes. Malformed input must end in ds::Error;
// anything parsed must be safe to read in full.
#include <cstddef>
#include <cstdint>
#include <span>

#include "core/error.h"
#include "formats/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const ds::GgufFile f = ds::GgufFile::parse(std::span<const uint8_t>(data, size), "fuzz.gguf");
    size_t sink = f.version() + f.alignment() + f.data_offset();
    for (const auto& [key, value] : f.metadata()) {
      sink += key.size() + value.to_string(4).size() + value.array_size();
      sink += value.as_int().value_or(0) != 0;
      sink += value.as_float().has_value() + value.as_string().has_value();
      try {
        sink += f.get_int(key).value_or(0) != 0;
      } catch (const ds::Error&) {
      }
      try {
        sink += f.get_string_array(key).size() + f.get_float_array(key).size();
        sink += f.get_int_array(key).size();
      } catch (const ds::Error&) {
      }
    }
    for (const auto& info : f.tensors()) {
      const ds::TensorView v = f.view(info);
      if (f.find_tensor(info.name) != &info) __builtin_trap();
      // TensorView::rows() divides by cols(), so empty rows are skipped.
      if (v.cols() > 0 && v.nbytes() != info.nbytes) __builtin_trap();
      const auto* p = static_cast<const uint8_t*>(v.data);
      for (size_t i = 0; i < info.nbytes; ++i) sink += p[i];  // in bounds, or ASan says so
    }
    volatile size_t keep = sink;
    (void)keep;
  } catch (const ds::Error&) {
  }
  return 0;
}
