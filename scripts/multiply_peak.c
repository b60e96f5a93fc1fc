/* The most integer multiply-adds a core issues a cycle: 12 independent chains of ymm vpdpbusd (AVX-VNNI), zmm vpdpbusd
 * (AVX512-VNNI) and ymm vpmaddubsw (AVX2), against the clock read off a loop of dependent adds (one a cycle). What an
 * extra activation row can cost at the least (docs/measurements.md, issue 49: the arithmetic floor of 4 and 8 rows).
 *
 * Usage: b=$(mktemp) && gcc -O2 -mavx2 -mavxvnni -mavx512f -mavx512vnni scripts/multiply_peak.c -o $b && $b
 * (loops the CPU lacks are skipped; gcc 11 or newer for -mavxvnni) */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ONE(OP, R, D) OP " %%" R "14, %%" R "15, %%" R D "\n "
#define CHAINS(OP, R)                                                                                                 \
    ONE(OP, R, "0") ONE(OP, R, "1") ONE(OP, R, "2") ONE(OP, R, "3") ONE(OP, R, "4") ONE(OP, R, "5") ONE(OP, R, "6")      \
    ONE(OP, R, "7") ONE(OP, R, "8") ONE(OP, R, "9") ONE(OP, R, "10") ONE(OP, R, "11")
#define CLOBBERS "rcx", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"

int main(void) {
    const long n = 200000000, m = 50000000;
    double t = now();
    __asm__ volatile("mov %0, %%rcx\n1:\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n sub $1, %%rcx\n"
                     " jnz 1b" ::"r"(n) : "rax", "rcx");
    const double hz = 4.0 * n / (now() - t);
    printf("clock %.2f GHz (dependent adds)\n", hz / 1e9);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        t = now();
        __asm__ volatile("mov %0, %%rcx\n1:\n " CHAINS("vpmaddubsw", "ymm") "sub $1, %%rcx\n jnz 1b" ::"r"(m) : CLOBBERS);
        printf("ymm vpmaddubsw: %.2f a cycle\n", 12.0 * m / (now() - t) / hz);
    }
    if (__builtin_cpu_supports("avxvnni")) {
        t = now();
        __asm__ volatile("mov %0, %%rcx\n1:\n " CHAINS("%{vex%} vpdpbusd", "ymm") "sub $1, %%rcx\n jnz 1b" ::"r"(m) : CLOBBERS);
        printf("ymm vpdpbusd: %.2f a cycle\n", 12.0 * m / (now() - t) / hz);
    }
    if (__builtin_cpu_supports("avx512vnni")) {
        t = now();
        __asm__ volatile("mov %0, %%rcx\n1:\n " CHAINS("vpdpbusd", "zmm") "sub $1, %%rcx\n jnz 1b" ::"r"(m) : CLOBBERS);
        printf("zmm vpdpbusd: %.2f a cycle\n", 12.0 * m / (now() - t) / hz);
    }
    return 0;
}
