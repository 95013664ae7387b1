// What the CPU can run (cpuid + OS register-state checks) and which kernel family to use.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace ds::cpu {

// Kernel families, ordered from least to most capable: a CPU that runs one runs all before it.
enum class Isa { Scalar, Avx2, Avx512Vnni, Amx };

struct CpuFeatures {
  std::string vendor;
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false, avx_vnni = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  // The OS saves the registers: XCR0 bits for ymm, zmm + opmask, and AMX tile data.
  bool os_avx = false, os_avx512 = false, os_amx = false;
  // Linux granted this process the AMX tile-data state (arch_prctl XCOMP_PERM).
  bool amx_permitted = false;
};

// Detected once, on first use.
const CpuFeatures& cpu_features();
bool isa_supported(Isa isa);
// The most capable family this CPU and OS support. AMX is reported only when the tile
// state is usable; matmul then runs its AVX-512 VNNI kernels until AMX kernels exist.
Isa detect_isa();
std::string_view isa_name(Isa isa);  // "scalar", "avx2", "avx512-vnni", "amx"
std::optional<Isa> isa_from_name(std::string_view name);
// Picks the family for a run: the detected one, or a lower one named by a CLI option or
// test (never raised above what the CPU supports). Throws ds::Error on an unknown name.
Isa select_isa(std::string_view override_name);
// Human-readable feature list for logs, e.g. "avx2 fma f16c avx512f ... (os: avx avx512)".
std::string describe(const CpuFeatures& f);

}  // namespace ds::cpu
