// GPUs before Ampere (sm_70, sm_75) lack three sm_80 instructions the kernels use: max.NaN,
// cvt.rn.bf16.f32 and cp.async (async_copy.cuh). CUKERN_FALLBACKS selects equivalents built
// from older instructions, bit for bit the same results; -DCUKERN_FORCE_FALLBACKS takes them on
// any GPU, so they can be tested on a newer one.
#pragma once

#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800) || defined(CUKERN_FORCE_FALLBACKS)
#define CUKERN_FALLBACKS 1
#endif
