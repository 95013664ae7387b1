#include "backend/cpu/cpu_features.h"

#include <cstdint>
#include <cstring>

#include "core/error.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ds::cpu {
namespace {

#if defined(__x86_64__)
struct Regs {
  uint32_t a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(uint32_t leaf, uint32_t sub) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) return Regs{};
  return r;
}

// xgetbv without needing -mxsave on this file.
uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return uint64_t(hi) << 32 | lo;
}

bool bit(uint32_t v, int i) {
  return (v >> i) & 1u;
}

// Linux keeps AMX tile data off until a process asks for it (kernel 5.16+).
bool request_amx_permission() {
#if defined(__linux__)
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
  return (bitmask >> kXfeatureXtiledata) & 1u;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
  const Regs r0 = cpuid(0, 0);
  char vendor[13] = {};
  std::memcpy(vendor, &r0.b, 4);
  std::memcpy(vendor + 4, &r0.d, 4);
  std::memcpy(vendor + 8, &r0.c, 4);
  f.vendor = vendor;
  const uint32_t max_leaf = r0.a;
  if (max_leaf < 1) return f;
  const Regs r1 = cpuid(1, 0);
  const bool osxsave = bit(r1.c, 27);
  f.fma = bit(r1.c, 12);
  f.f16c = bit(r1.c, 29);
  const bool avx = bit(r1.c, 28);
  const uint64_t xcr = osxsave ? xcr0() : 0;
  f.os_avx = avx && (xcr & 0x6) == 0x6;
  f.os_avx512 = f.os_avx && (xcr & 0xe0) == 0xe0;
  f.os_amx = (xcr & 0x60000) == 0x60000;
  if (max_leaf >= 7) {
    const Regs r7 = cpuid(7, 0);
    f.avx2 = bit(r7.b, 5);
    f.avx512f = bit(r7.b, 16);
    f.avx512dq = bit(r7.b, 17);
    f.avx512bw = bit(r7.b, 30);
    f.avx512vl = bit(r7.b, 31);
    f.avx512vnni = bit(r7.c, 11);
    f.amx_bf16 = bit(r7.d, 22);
    f.amx_tile = bit(r7.d, 24);
    f.amx_int8 = bit(r7.d, 25);
    if (r7.a >= 1) {
      const Regs r71 = cpuid(7, 1);
      f.avx_vnni = bit(r71.a, 4);
      f.avx512bf16 = bit(r71.a, 5);
    }
  }
  if (f.amx_tile && f.amx_int8 && f.os_amx) f.amx_permitted = request_amx_permission();
  return f;
}
#else
CpuFeatures detect() {
  return CpuFeatures{};
}
#endif

constexpr std::string_view kNames[] = {"scalar", "avx2", "avx512-vnni", "amx"};

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.os_avx && f.avx2 && f.fma && f.f16c;
  const bool avx512 =
      avx2 && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni;
  switch (isa) {
    case Isa::Scalar:
      return true;
    case Isa::Avx2:
      return avx2;
    case Isa::Avx512Vnni:
      return avx512;
    case Isa::Amx:
      return avx512 && f.amx_tile && f.amx_int8 && f.amx_permitted;
  }
  return false;
}

Isa detect_isa() {
  for (Isa isa : {Isa::Amx, Isa::Avx512Vnni, Isa::Avx2})
    if (isa_supported(isa)) return isa;
  return Isa::Scalar;
}

std::string_view isa_name(Isa isa) {
  const auto i = static_cast<size_t>(isa);
  return i < std::size(kNames) ? kNames[i] : "?";
}

std::optional<Isa> isa_from_name(std::string_view name) {
  for (size_t i = 0; i < std::size(kNames); ++i)
    if (kNames[i] == name) return static_cast<Isa>(i);
  if (name == "avx512") return Isa::Avx512Vnni;
  return std::nullopt;
}

Isa select_isa(std::string_view override_name) {
  const Isa best = detect_isa();
  if (override_name.empty() || override_name == "auto") return best;
  const auto want = isa_from_name(override_name);
  if (!want)
    throw Error("unknown ISA '" + std::string(override_name) +
                "' (expected auto, scalar, avx2, avx512-vnni or amx)");
  return static_cast<int>(*want) < static_cast<int>(best) ? *want : best;
}

std::string describe(const CpuFeatures& f) {
  std::string s = f.vendor;
  auto add = [&](bool on, const char* name) {
    if (on) s += std::string(" ") + name;
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512dq, "avx512dq");
  add(f.avx512vnni, "avx512vnni");
  add(f.avx512bf16, "avx512bf16");
  add(f.avx_vnni, "avxvnni");
  add(f.amx_tile, "amx-tile");
  add(f.amx_int8, "amx-int8");
  add(f.amx_bf16, "amx-bf16");
  s += " (os:";
  add(f.os_avx, "avx");
  add(f.os_avx512, "avx512");
  add(f.os_amx, "amx");
  add(f.amx_permitted, "amx-permitted");
  return s + ")";
}

}  // namespace ds::cpu
