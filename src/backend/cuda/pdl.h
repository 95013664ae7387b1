// Host side of programmatic dependent launch (see pdl.cuh): whether launches carry the attribute.
#pragma once

namespace ds::cuda::pdl {

// sm_90+ and the switch g_pdl (DEEPSERVE_PDL != "0"; tests force it, switches.h).
bool enabled();
// The kernels that can ask L2 for their weights before they wait (pdl.cuh, prefetch_l2).
enum class PrefetchKind : int { Skinny = 1, DenseWq = 2, MoeDown = 4 };
// The most bytes a CTA of that kind asks for, 0 for none: sm_90+, the switch g_prefetch (off
// unless DEEPSERVE_PREFETCH=1), the kind among DEEPSERVE_PREFETCH_KINDS (bits, default all),
// capped at DEEPSERVE_PREFETCH_CAP bytes (default: none).
long long prefetch_bytes(PrefetchKind kind);
// Whether the current device is sm_90 or newer (thread-block clusters, dependent launch).
bool hopper();

}  // namespace ds::cuda::pdl
