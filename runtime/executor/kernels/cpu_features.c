/* What this CPU runs, for picking kernel variants at load (compiled for the baseline ISA,
 * so it runs everywhere). The numbers index cpu_library.FLOAT_ISAS and
 * cpu_quant_ops.ISAS. GCC's feature checks include the OS's support (XCR0) for the wide
 * registers. */
#include <stdint.h>

/* 0 portable, 1 AVX2 + FMA + F16C, 2 AVX-512 (F, BW, VL, DQ) on top of those. */
int64_t spruce_float_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (avx2 && avx512) return 2;
    if (avx2) return 1;
#endif
    return 0;
}

/* 0 scalar, 1 AVX2 (vpmaddwd), 2 AVX512-VNNI (vpdpwssd on 256-bit registers). */
int64_t spruce_quant_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return 1;
#endif
    return 0;
}
