// libFuzzer target: SafetensorsFile::parse on arbitrary bytes. Malformed input must end in
// ds::Error; anything parsed must be safe to read in full.
#include <cstddef>
#include <cstdint>
#include <span>

#include "core/error.h"
#include "formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const ds::SafetensorsFile f =
        ds::SafetensorsFile::parse(std::span<const uint8_t>(data, size), "fuzz.safetensors");
    size_t sink = 0;
    for (const auto& [key, value] : f.metadata()) sink += key.size() + value.size();
    for (const auto& t : f.tensors()) {
      if (f.find(t.name) != &t) __builtin_trap();
      try {
        const ds::TensorView v = f.view(t);
        // TensorView::rows() divides by cols(), so empty rows are skipped.
        if (v.cols() > 0 && v.nbytes() != t.nbytes) __builtin_trap();
      } catch (const ds::Error&) {  // rank above 4 has no view
      }
      const uint8_t* p = data + t.offset;
      for (size_t i = 0; i < t.nbytes; ++i) sink += p[i];  // in bounds, or ASan says so
    }
    volatile size_t keep = sink;
    (void)keep;
  } catch (const ds::Error&) {
  }
  return 0;
}
