// Host side of programmatic dependent launch (see pdl.cuh): whether launches carry the attribute.
#pragma once

namespace ds::cuda::pdl {

// sm_90+ and DEEPSERVE_PDL != "0", unless force() said otherwise.
bool enabled();

// Tests and A/B runs: 1 on (where the GPU has it), 0 off, -1 back to the environment's choice.
void force(int mode);

}  // namespace ds::cuda::pdl
