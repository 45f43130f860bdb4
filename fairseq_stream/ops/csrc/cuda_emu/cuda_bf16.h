// Emulation stand-in (see cuda_runtime.h): bfloat16 logits are not emulated, only the type exists.
#pragma once
struct __nv_bfloat16 {
  float v;
};
inline float __bfloat162float(__nv_bfloat16 h) { return h.v; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {f}; }
