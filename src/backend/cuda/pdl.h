// Host side of programmatic dependent launch (see pdl.cuh): whether launches carry the attribute.
#pragma once

namespace ds::cuda::pdl {

// sm_90+ and the switch g_pdl (DEEPSERVE_PDL != "0"; tests force it, switches.h).
bool enabled();

}  // namespace ds::cuda::pdl
