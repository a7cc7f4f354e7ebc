/* Probe (not product code; docs/performance.md "A 16-bit KV cache for the C attention"): one decode
 * step's attention over 30 layers, the loops of kernels/cpu_paged.c `decode_seq_dim` (each sequence's
 * K/V one contiguous block, every layer its own), K/V float32 against bf16 widened per element, float32
 * queries and sums, one thread: 32 sequences of 76-356 tokens, 9 query heads over 3 KV heads of 64.
 *
 *     cc -O3 -march=native -fno-math-errno -fno-trapping-math -ffinite-math-only -fno-signed-zeros \
 *        -fassociative-math -fopenmp-simd -o /tmp/bf16_kv benchmarks/probes/bf16_kv.c -lm
 *     /tmp/bf16_kv fp32|bf16 [REPS [LAYERS]]
 *
 * Before timing, bf16 K/V is checked against float32 holding the same (bf16-representable) values (exit
 * 1 if they disagree). Prints the best step over REPS (default 15) of LAYERS (default 30). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "probe.h"

#define D 64
#define QH 9
#define KH 3
#define GROUP (QH / KH)
#define LAYERS 30 /* the most; argv[3] may ask for fewer (the tests' short run) */
#define SEQS 32

static inline float id(float x) { return x; }

/* out [QH, D] = softmax(q k^T / 8) v over n tokens; k, v [n, KH, D] */
#define ATTEND(NAME, T, LOAD)                                                                           \
    static void NAME(const float *q, const T *k, const T *v, int n, float *out, float *scores) {       \
        for (int t = 0; t < n; t++)                                                                     \
            for (int g = 0; g < KH; g++) {                                                              \
                const T *kh = k + (t * KH + g) * D;                                                     \
                for (int h = g * GROUP; h < (g + 1) * GROUP; h++) {                                     \
                    const float *qh = q + h * D;                                                        \
                    float acc = 0.0f;                                                                   \
                    _Pragma("omp simd reduction(+ : acc)") for (int d = 0; d < D; d++) acc +=           \
                        qh[d] * LOAD(kh[d]);                                                            \
                    scores[h * n + t] = acc * 0.125f;                                                   \
                }                                                                                       \
            }                                                                                           \
        for (int h = 0; h < QH; h++) {                                                                  \
            float *s = scores + h * n, m = s[0], sum = 0.0f;                                            \
            for (int t = 1; t < n; t++) m = s[t] > m ? s[t] : m;                                        \
            for (int t = 0; t < n; t++) sum += s[t] = expf(s[t] - m);                                   \
            for (int t = 0; t < n; t++) s[t] /= sum;                                                    \
        }                                                                                               \
        memset(out, 0, QH * D * sizeof(float));                                                         \
        for (int t = 0; t < n; t++)                                                                     \
            for (int g = 0; g < KH; g++) {                                                              \
                const T *restrict vh = v + (t * KH + g) * D;                                            \
                for (int h = g * GROUP; h < (g + 1) * GROUP; h++) {                                     \
                    const float p = scores[h * n + t];                                                  \
                    float *restrict o = out + h * D;                                                    \
                    _Pragma("omp simd") for (int d = 0; d < D; d++) o[d] += p * LOAD(vh[d]);            \
                }                                                                                       \
            }                                                                                           \
    }
ATTEND(attend_fp32, float, id)
ATTEND(attend_bf16, uint16_t, from_bf16)

/* bf16 K/V gives what float32 holding the same values gives */
static int agree(void) {
    enum { N = 100, ROW = N * KH * D };
    static float k32[ROW], v32[ROW], q[QH * D], want[QH * D], got[QH * D], scores[QH * N];
    static uint16_t k16[ROW], v16[ROW];
    srand(1);
    for (int i = 0; i < 2 * ROW; i++) { /* a float cut to its upper 16 bits, and those bits */
        const uint16_t h = bf16_cut((float)rand() / RAND_MAX - 0.5f);
        const uint32_t u = (uint32_t)h << 16; /* not from_bf16: the check is of it */
        memcpy(i < ROW ? &k32[i] : &v32[i - ROW], &u, 4);
        (i < ROW ? k16 : v16)[i % ROW] = h;
    }
    for (int i = 0; i < QH * D; i++) q[i] = (float)rand() / RAND_MAX - 0.5f;
    attend_fp32(q, k32, v32, N, want, scores);
    attend_bf16(q, k16, v16, N, got, scores);
    for (int i = 0; i < QH * D; i++)
        if (fabsf(want[i] - got[i]) > 1e-6f * (1.0f + fabsf(want[i])) || want[i] != want[i]) return 0;
    return 1;
}

int main(int argc, char **argv) {
    const int bf16 = argc > 1 && !strcmp(argv[1], "bf16"), reps = argc > 2 ? atoi(argv[2]) : 15;
    const int layers = argc > 3 ? atoi(argv[3]) : LAYERS;
    const size_t elem = bf16 ? 2 : 4;
    if (reps < 1 || layers < 1 || layers > LAYERS) return fprintf(stderr, "REPS >= 1, LAYERS 1..30\n"), 2;
    if (!agree()) return fprintf(stderr, "bf16 K/V disagrees with float32\n"), 1;
    int ctx[SEQS];
    void *k[LAYERS][SEQS], *v[LAYERS][SEQS];
    double bytes = 0;
    for (int s = 0; s < SEQS; s++) ctx[s] = 76 + (356 - 76) * s / (SEQS - 1);
    for (int l = 0; l < layers; l++)
        for (int s = 0; s < SEQS; s++) {
            const size_t sz = (size_t)ctx[s] * KH * D * elem, padded = (sz + 63) / 64 * 64;
            bytes += 2.0 * sz;
            k[l][s] = aligned_alloc(64, padded), v[l][s] = aligned_alloc(64, padded);
            memset(k[l][s], 0x3c, sz), memset(v[l][s], 0x3c, sz); /* ~0.01 in either format */
        }
    float q[QH * D], out[QH * D], *scores = malloc(QH * 400 * sizeof(float));
    for (int i = 0; i < QH * D; i++) q[i] = 0.01f * (float)(i % 13);
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        for (int l = 0; l < layers; l++)
            for (int s = 0; s < SEQS; s++) {
                if (bf16) attend_bf16(q, k[l][s], v[l][s], ctx[s], out, scores);
                else attend_fp32(q, k[l][s], v[l][s], ctx[s], out, scores);
            }
        const double t = (now_s() - t0) * 1e3;
        best = t < best ? t : best;
    }
    printf("%s: best %.2f ms a step, %.0f MB of K/V (%.1f GB/s)\n", bf16 ? "bf16" : "fp32", best, bytes / 1e6,
           bytes / (best * 1e-3) / 1e9);
    return 0;
}
