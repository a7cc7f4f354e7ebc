/* Probe (not product code; docs/performance.md "The file's own bits"): the packed tile of
 * kernels/cpu_paged.c on float32 weight panels against the same weights kept as the bundled GGUF stores
 * them (Q4_1: per 32 inputs of one output, w = d * q + m, q a 4-bit integer), float32 arithmetic, one
 * thread, on a decode step's projections of SmolLM2-135M (30 layers, each its own weights; no LM head).
 * Needs AVX-512 (16-float vectors).
 *
 *     cc -O3 -march=native -fno-math-errno -fno-trapping-math -ffinite-math-only -fno-signed-zeros \
 *        -fassociative-math -o /tmp/q4_panels benchmarks/probes/q4_panels.c
 *     /tmp/q4_panels ROWS fp32|q4|q4s [REPS [LAYERS]]
 *
 * q4: a panel of 32 outputs is a run of 32-input blocks, each 512 bytes of nibbles (row i's byte j:
 * output j in the low nibble, output 16 + j in the high one) and the 32 outputs' d and m as float32
 * (the file's float16, widened exactly): 6 bits a weight against float32's 32. Each block's sum is
 * factored, sum_i x_i (d q_i + m) = d * sum_i x_i q_i + m * sum_i x_i, so a weight costs the same two
 * multiply-adds as float32 plus its nibble's widening; sum_i x_i is computed once per row and block for
 * every panel. Before timing it checks q4 against float32 on the dequantized weights (exit 1 beyond a
 * relative 1e-5 of the sum of |terms|: the factored sum rounds in another order). Prints the best step
 * over REPS (default 20); LAYERS (default 30). q4s: the same sums through a scratch, each block's nibbles
 * widened once into L1 for every row tile (slower at every row count measured: not what was built). The
 * product's tile is kernels/cpu_paged.c's packed_tile_q4 (docs/performance.md "The file's own bits"). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "probe.h"

#define V 16
#define P (2 * V)
#define QB 32 /* inputs per Q4_1 block */
#define BLOCK_BYTES (QB * V + 2 * P * 4)
typedef float fv __attribute__((vector_size(V * 4), aligned(4)));
typedef int32_t iv __attribute__((vector_size(V * 4), aligned(4)));
enum { FP32, Q4, Q4S };

/* y[r, 0..P) = x[r, :] . panel for r < mr (float32 panel: the product's packed_tile) */
static inline __attribute__((always_inline)) void tile_fp32(const float *restrict x, int64_t k, const int mr,
                                                            const float *restrict p, float *restrict y,
                                                            int64_t n) {
    fv lo[8], hi[8];
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = (fv){0};
    for (int64_t i = 0; i < k; i++) {
        const fv b0 = *(const fv *)(p + i * P), b1 = *(const fv *)(p + i * P + V);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * k + i];
            lo[r] += a * b0;
            hi[r] += a * b1;
        }
    }
    for (int r = 0; r < mr; r++) *(fv *)(y + r * n) = lo[r], *(fv *)(y + r * n + V) = hi[r];
}

/* the same on a q4 panel; xs[r, b]: sum of row r's inputs in block b */
static inline __attribute__((always_inline)) void tile_q4(const float *restrict x, const float *restrict xs,
                                                          int64_t k, const int mr, const uint8_t *restrict p,
                                                          float *restrict y, int64_t n) {
    fv lo[8], hi[8];
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = (fv){0};
    for (int64_t b = 0; b < k / QB; b++) {
        const uint8_t *blk = p + b * BLOCK_BYTES;
        fv qlo[8], qhi[8];
        for (int r = 0; r < mr; r++) qlo[r] = qhi[r] = (fv){0};
        for (int i = 0; i < QB; i++) {
            const iv u = (iv)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + i * V)));
            const fv q0 = __builtin_convertvector(u & 15, fv), q1 = __builtin_convertvector(u >> 4, fv);
            for (int r = 0; r < mr; r++) {
                const float a = x[r * k + b * QB + i];
                qlo[r] += a * q0;
                qhi[r] += a * q1;
            }
        }
        const float *dm = (const float *)(blk + QB * V);
        const fv d0 = *(const fv *)dm, d1 = *(const fv *)(dm + V);
        const fv m0 = *(const fv *)(dm + P), m1 = *(const fv *)(dm + P + V);
        for (int r = 0; r < mr; r++) {
            const float s = xs[r * (k / QB) + b];
            lo[r] += d0 * qlo[r] + s * m0;
            hi[r] += d1 * qhi[r] + s * m1;
        }
    }
    for (int r = 0; r < mr; r++) *(fv *)(y + r * n) = lo[r], *(fv *)(y + r * n + V) = hi[r];
}

/* the same sums through a scratch: each block's nibbles widened once into qf [QB][P], every row tile
 * reading them from L1; y [rows, n] carries each row's sums between blocks */
static inline __attribute__((always_inline)) void block_q4(const float *restrict x, const float *restrict xs,
                                                           int64_t k, int64_t b, const int mr,
                                                           const float *restrict qf, const float *dm,
                                                           float *restrict y, int64_t n) {
    fv qlo[8], qhi[8];
    for (int r = 0; r < mr; r++) qlo[r] = qhi[r] = (fv){0};
    for (int i = 0; i < QB; i++) {
        const fv q0 = *(const fv *)(qf + i * P), q1 = *(const fv *)(qf + i * P + V);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * k + b * QB + i];
            qlo[r] += a * q0;
            qhi[r] += a * q1;
        }
    }
    const fv d0 = *(const fv *)dm, d1 = *(const fv *)(dm + V);
    const fv m0 = *(const fv *)(dm + P), m1 = *(const fv *)(dm + P + V);
    for (int r = 0; r < mr; r++) {
        const float s = xs[r * (k / QB) + b];
        fv lo = b ? *(fv *)(y + r * n) : (fv){0}, hi = b ? *(fv *)(y + r * n + V) : (fv){0};
        lo = (fv)_mm512_fmadd_ps((__m512)d0, (__m512)qlo[r], (__m512)lo);
        hi = (fv)_mm512_fmadd_ps((__m512)d1, (__m512)qhi[r], (__m512)hi);
        *(fv *)(y + r * n) = (fv)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)m0, (__m512)lo);
        *(fv *)(y + r * n + V) = (fv)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)m1, (__m512)hi);
    }
}

static void panel_q4s(const float *x, const float *xs, int64_t rows, int64_t k, const uint8_t *p, float *y,
                      int64_t n) {
    float qf[QB * P] __attribute__((aligned(64)));
    for (int64_t b = 0; b < k / QB; b++) {
        const uint8_t *blk = p + b * BLOCK_BYTES;
        for (int i = 0; i < QB; i++) {
            const iv u = (iv)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + i * V)));
            *(fv *)(qf + i * P) = __builtin_convertvector(u & 15, fv);
            *(fv *)(qf + i * P + V) = __builtin_convertvector(u >> 4, fv);
        }
        const float *dm = (const float *)(blk + QB * V);
        for (int64_t m = 0; m < rows; m += 8) {
            const int mr = rows - m < 8 ? (int)(rows - m) : 8;
            const float *xm = x + m * k, *xsm = xs + m * (k / QB);
            float *ym = y + m * n;
            switch (mr) {
            case 1: block_q4(xm, xsm, k, b, 1, qf, dm, ym, n); break;
            case 2: block_q4(xm, xsm, k, b, 2, qf, dm, ym, n); break;
            case 3: block_q4(xm, xsm, k, b, 3, qf, dm, ym, n); break;
            case 4: block_q4(xm, xsm, k, b, 4, qf, dm, ym, n); break;
            case 5: block_q4(xm, xsm, k, b, 5, qf, dm, ym, n); break;
            case 6: block_q4(xm, xsm, k, b, 6, qf, dm, ym, n); break;
            case 7: block_q4(xm, xsm, k, b, 7, qf, dm, ym, n); break;
            default: block_q4(xm, xsm, k, b, 8, qf, dm, ym, n);
            }
        }
    }
}

#define ROWS(CALL)                                                                                    \
    switch (mr) {                                                                                     \
    case 1: CALL(1); break;                                                                           \
    case 2: CALL(2); break;                                                                           \
    case 3: CALL(3); break;                                                                           \
    case 4: CALL(4); break;                                                                           \
    case 5: CALL(5); break;                                                                           \
    case 6: CALL(6); break;                                                                           \
    case 7: CALL(7); break;                                                                           \
    default: CALL(8);                                                                                 \
    }
#define FP32_TILE(R) tile_fp32(xm, k, R, (const float *)w + q * k * P, ym, n)
#define Q4_TILE(R) tile_q4(xm, xsm, k, R, (const uint8_t *)w + q * (k / QB) * BLOCK_BYTES, ym, n)

/* y [rows, n] = x [rows, k] W^T, W packed in panels of P outputs in `layout`; xs: scratch [rows, k / QB] */
static void linear(int layout, const float *x, int64_t rows, const void *w, int64_t n, int64_t k, float *y,
                   float *xs) {
    if (layout != FP32)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < k / QB; b++) {
                float s = 0;
                for (int i = 0; i < QB; i++) s += x[r * k + b * QB + i];
                xs[r * (k / QB) + b] = s;
            }
    if (layout == Q4S) {
        for (int64_t q = 0; q < n / P; q++)
            panel_q4s(x, xs, rows, k, (const uint8_t *)w + q * (k / QB) * BLOCK_BYTES, y + q * P, n);
        return;
    }
    for (int64_t q = 0; q < n / P; q++)
        for (int64_t m = 0; m < rows; m += 8) {
            const int mr = rows - m < 8 ? (int)(rows - m) : 8;
            const float *xm = x + m * k, *xsm = xs + m * (k / QB);
            float *ym = y + m * n + q * P;
            if (layout == FP32) {
                ROWS(FP32_TILE)
            } else {
                ROWS(Q4_TILE)
            }
        }
}

/* Q4_1 weights [n, k] as the file gives them: qs [n, k] in 0..15, d and m [n, k / QB] */
typedef struct {
    uint8_t *qs;
    float *d, *m;
} Q41;

static float dequantized(const Q41 *w, int64_t k, int64_t o, int64_t i) {
    return w->d[o * (k / QB) + i / QB] * (float)w->qs[o * k + i] + w->m[o * (k / QB) + i / QB];
}

static void *pack(int layout, const Q41 *w, int64_t n, int64_t k) {
    if (layout == FP32) {
        float *p = aligned_alloc(64, (size_t)(n * k) * 4);
        for (int64_t q = 0; q < n / P; q++)
            for (int64_t i = 0; i < k; i++)
                for (int64_t j = 0; j < P; j++) p[(q * k + i) * P + j] = dequantized(w, k, q * P + j, i);
        return p;
    }
    uint8_t *p = aligned_alloc(64, (size_t)((n / P) * (k / QB) * BLOCK_BYTES));
    for (int64_t q = 0; q < n / P; q++)
        for (int64_t b = 0; b < k / QB; b++) {
            uint8_t *blk = p + (q * (k / QB) + b) * BLOCK_BYTES;
            float *dm = (float *)(blk + QB * V);
            for (int64_t j = 0; j < P; j++) {
                dm[j] = w->d[(q * P + j) * (k / QB) + b];
                dm[P + j] = w->m[(q * P + j) * (k / QB) + b];
            }
            for (int i = 0; i < QB; i++)
                for (int j = 0; j < V; j++)
                    blk[i * V + j] = (uint8_t)(w->qs[(q * P + j) * k + b * QB + i] |
                                               w->qs[(q * P + V + j) * k + b * QB + i] << 4);
        }
    return p;
}

static Q41 random_q41(int64_t n, int64_t k, int fill) {
    Q41 w = {malloc((size_t)(n * k)), malloc((size_t)(n * k / QB) * 4), malloc((size_t)(n * k / QB) * 4)};
    for (int64_t i = 0; i < n * k; i++) w.qs[i] = fill ? (uint8_t)(i % 16) : (uint8_t)(rand() % 16);
    for (int64_t i = 0; i < n * k / QB; i++) {
        w.d[i] = fill ? 0.001f : (float)rand() / RAND_MAX * 0.01f;
        w.m[i] = fill ? -0.0075f : -(float)rand() / RAND_MAX * 0.08f;
    }
    return w;
}

/* q4 gives float32's output on the dequantized weights, to a relative 1e-5 of the terms' magnitude */
static int agree(void) {
    const int64_t n = 64, k = 96, rows = 5;
    float x[5 * 96], xs[5 * 3], want[5 * 64], got[5 * 64];
    srand(1);
    Q41 w = random_q41(n, k, 0);
    for (int i = 0; i < rows * k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    void *p32 = pack(FP32, &w, n, k), *p4 = pack(Q4, &w, n, k);
    float got_s[5 * 64];
    linear(FP32, x, rows, p32, n, k, want, xs);
    linear(Q4, x, rows, p4, n, k, got, xs);
    linear(Q4S, x, rows, p4, n, k, got_s, xs);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < n; o++) {
            double s = 0, mag = 0;
            for (int64_t i = 0; i < k; i++) {
                const double t = (double)x[r * k + i] * dequantized(&w, k, o, i);
                s += t, mag += fabs(t);
            }
            if (fabs(s - want[r * n + o]) > 1e-5 * mag || fabs(s - got[r * n + o]) > 1e-5 * mag ||
                fabs(s - got_s[r * n + o]) > 1e-5 * mag)
                return 0;
        }
    free(p32), free(p4);
    return 1;
}

int main(int argc, char **argv) {
    const int rows = argc > 1 ? atoi(argv[1]) : 1, reps = argc > 3 ? atoi(argv[3]) : 20;
    const int layers = argc > 4 ? atoi(argv[4]) : 30;
    const char *name = argc > 2 ? argv[2] : "fp32";
    const int layout = !strcmp(name, "q4s") ? Q4S : !strcmp(name, "q4") ? Q4 : FP32;
    if (rows < 1 || rows > 64 || reps < 1 || layers < 1 || layers > 30)
        return fprintf(stderr, "ROWS 1..64, REPS >= 1, LAYERS 1..30\n"), 2;
    if (!agree()) return fprintf(stderr, "q4 disagrees with float32\n"), 1;
    /* per layer: qkv, o, gate_up, down ([n, k]) */
    const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    void *w[120];
    double bytes = 0;
    for (int c = 0; c < 4 * layers; c++) {
        const int64_t n = shapes[c % 4][0], k = shapes[c % 4][1];
        Q41 q = random_q41(n, k, 1);
        w[c] = pack(layout, &q, n, k);
        bytes += layout == FP32 ? (double)(n * k) * 4 : (double)((n / P) * (k / QB) * BLOCK_BYTES);
        free(q.qs), free(q.d), free(q.m);
    }
    float *x = aligned_alloc(64, 64 * 1536 * 4), *y = aligned_alloc(64, 64 * 3072 * 4);
    float *xs = aligned_alloc(64, 64 * 1536 / QB * 4);
    for (int i = 0; i < 64 * 1536; i++) x[i] = (float)(i % 7) * 0.01f;
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        for (int c = 0; c < 4 * layers; c++) linear(layout, x, rows, w[c], shapes[c % 4][0], shapes[c % 4][1], y, xs);
        const double t = (now_s() - t0) * 1e3;
        best = t < best ? t : best;
    }
    printf("%s rows %d: best %.2f ms a step, %.0f MB of weights (%.1f GB/s)\n", name, rows, best, bytes / 1e6,
           bytes / (best * 1e-3) / 1e9);
    return 0;
}
