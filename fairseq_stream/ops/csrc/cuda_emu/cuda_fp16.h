// Emulation stand-in (see cuda_runtime.h): half logits are not emulated, only the type exists.
#pragma once
struct __half {
  float v;
};
inline float __half2float(__half h) { return h.v; }
inline __half __float2half_rn(float f) { return {f}; }
