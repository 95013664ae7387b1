// Host side of programmatic dependent launch (see pdl.cuh): whether launches carry the attribute.
#pragma once

namespace ds::cuda::pdl {

// sm_90+ and the switch g_pdl (DEEPSERVE_PDL != "0"; tests force it, switches.h).
bool enabled();
// Whether kernels ask L2 for their weights before they wait (pdl.cuh, prefetch_l2): sm_90+ and
// the switch g_prefetch (off unless DEEPSERVE_PREFETCH=1).
bool prefetch();
// Whether the current device is sm_90 or newer (thread-block clusters, dependent launch).
bool hopper();

}  // namespace ds::cuda::pdl
