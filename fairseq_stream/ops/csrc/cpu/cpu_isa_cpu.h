// Which x86 vector extensions the compiled kernels may use: those the CPU reports, capped where ATen's
// own dispatch is capped (ATEN_CPU_CAPABILITY=avx2 or default, read by at::get_cpu_capability()).
//
// Why one knob for torch's kernels and ours: an AVX-512 machine set to avx2 then runs the kernels an
// AVX2-only CPU would (its tests and its benchmark paths, on a machine that has no EPYC beside it), and a
// user who turns torch's AVX-512 off for a reason (clock throttling, a faulty build) turns ours off too.
// The choice changes speed only: every int8 and int16 kernel computes the same integer sums.

#pragma once

#include <ATen/Version.h>

#include <string>

namespace fs_cpu {

enum class Level { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// ATen's dispatch level, read once (ATen reads its environment variable once too).
inline Level aten_level() {
  static const Level level = [] {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") return Level::kAvx512;
    if (capability == "AVX2") return Level::kAvx2;
    return Level::kPortable;
  }();
  return level;
}

#if defined(__x86_64__) || defined(__i386__)
// An AVX2 kernel may run: the CPU has AVX2 and ATen dispatches at AVX2 or above.
inline bool allows_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && aten_level() >= Level::kAvx2;
}

// An AVX-512 kernel may run, given the CPU has the extensions it names (checked by the caller).
inline bool allows_avx512() { return aten_level() >= Level::kAvx512; }
#endif

}  // namespace fs_cpu
