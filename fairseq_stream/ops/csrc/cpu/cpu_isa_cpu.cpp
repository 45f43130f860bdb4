// The x86 extensions this build's generic code was compiled for (setup.py's -march), as a string in the
// library's data that Python reads from the file before it loads the library (fairseq_stream/cpu_info.py).
//
// Why: every function of the library, its load-time initializers included, may use what -march allows; a
// build for an AVX-512 machine (FAIRSEQ_STREAM_MARCH=native) loaded on an AVX2-only one, or the x86-64-v3
// baseline on a CPU without AVX2, would die with an illegal instruction instead of falling back to torch
// ops with one log line. The compiler's own macros name what it was allowed to use, so the record cannot
// disagree with the code. Names are /proc/cpuinfo's; the list covers the extensions a compiler uses for
// ordinary (non-intrinsic) code. The kernels with target attributes are not counted: they run only where
// the CPU reports their extensions (cpu_isa_cpu.h).

extern "C" __attribute__((used, visibility("default"))) const char fairseq_stream_build_needs[] =
    "fairseq-stream-build-needs:"
#if defined(__SSE4_2__)
    " sse4_2"
#endif
#if defined(__POPCNT__)
    " popcnt"
#endif
#if defined(__AVX__)
    " avx"
#endif
#if defined(__AVX2__)
    " avx2"
#endif
#if defined(__FMA__)
    " fma"
#endif
#if defined(__F16C__)
    " f16c"
#endif
#if defined(__BMI__)
    " bmi1"
#endif
#if defined(__BMI2__)
    " bmi2"
#endif
#if defined(__LZCNT__)
    " abm"
#endif
#if defined(__MOVBE__)
    " movbe"
#endif
#if defined(__AVX512F__)
    " avx512f"
#endif
#if defined(__AVX512CD__)
    " avx512cd"
#endif
#if defined(__AVX512BW__)
    " avx512bw"
#endif
#if defined(__AVX512DQ__)
    " avx512dq"
#endif
#if defined(__AVX512VL__)
    " avx512vl"
#endif
#if defined(__AVX512IFMA__)
    " avx512ifma"
#endif
#if defined(__AVX512VBMI__)
    " avx512vbmi"
#endif
#if defined(__AVX512VBMI2__)
    " avx512_vbmi2"
#endif
#if defined(__AVX512VNNI__)
    " avx512_vnni"
#endif
#if defined(__AVX512BITALG__)
    " avx512_bitalg"
#endif
#if defined(__AVX512VPOPCNTDQ__)
    " avx512_vpopcntdq"
#endif
#if defined(__AVX512BF16__)
    " avx512_bf16"
#endif
#if defined(__AVX512FP16__)
    " avx512_fp16"
#endif
#if defined(__AVXVNNI__)
    " avx_vnni"
#endif
#if defined(__GFNI__)
    " gfni"
#endif
#if defined(__VAES__)
    " vaes"
#endif
#if defined(__VPCLMULQDQ__)
    " vpclmulqdq"
#endif
    ;
