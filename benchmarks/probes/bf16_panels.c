/* Probe (not product code; docs/performance.md "Workers sharing a machine"): the packed tile of
 * kernels/cpu_paged.c on float32 weight panels against bf16 panels widened to float32 in registers,
 * float32 arithmetic, one thread, on a decode step's projections of SmolLM2-135M (30 layers, each its
 * own weights, and the tied LM head). Needs AVX-512 (16-float vectors).
 *
 *     cc -O3 -march=native -fno-math-errno -fno-trapping-math -ffinite-math-only -fno-signed-zeros \
 *        -fassociative-math -o /tmp/bf16_panels benchmarks/probes/bf16_panels.c
 *     /tmp/bf16_panels ROWS fp32|bf16|bf16p [REPS [LAYERS]]
 *
 * bf16: each panel row holds 32 bf16, widened by zero-extend and shift; bf16p ("pairs"): 16 32-bit
 * words, word j holding column j's bf16 in its high half and column 16 + j's in its low half, so
 * `u & 0xFFFF0000` and `u << 16` are the two vectors without a shuffle. Before timing, every layout's
 * output is checked against float32 on bf16-representable weights (exit 1 if they disagree). Prints the
 * best step over REPS (default 20); LAYERS (default 30, the model: its LM head only then). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "probe.h"

#define V 16
#define P (2 * V)
typedef float fv __attribute__((vector_size(V * 4), aligned(4)));
typedef uint16_t hv __attribute__((vector_size(V * 2), aligned(2)));
typedef uint32_t uv __attribute__((vector_size(V * 4), aligned(4)));
enum { FP32, BF16, PAIRS };

static inline fv widen(hv h) { return (fv)(__builtin_convertvector(h, uv) << 16); }

/* y[r, 0..P) = x[r, :] . panel for r < mr: the product's packed_tile, the panel in `layout` */
static inline __attribute__((always_inline)) void tile(const int layout, const float *restrict x, int64_t k,
                                                       const int mr, const void *restrict p,
                                                       float *restrict y, int64_t n) {
    fv lo[8], hi[8];
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = (fv){0};
    for (int64_t i = 0; i < k; i++) {
        fv b0, b1;
        if (layout == FP32) {
            b0 = *(const fv *)((const float *)p + i * P), b1 = *(const fv *)((const float *)p + i * P + V);
        } else if (layout == BF16) {
            b0 = widen(*(const hv *)((const uint16_t *)p + i * P));
            b1 = widen(*(const hv *)((const uint16_t *)p + i * P + V));
        } else {
            const uv u = *(const uv *)((const uint32_t *)p + i * V);
            b0 = (fv)(u & 0xFFFF0000u), b1 = (fv)(u << 16);
        }
        for (int r = 0; r < mr; r++) {
            const float a = x[r * k + i];
            lo[r] += a * b0;
            hi[r] += a * b1;
        }
    }
    for (int r = 0; r < mr; r++) *(fv *)(y + r * n) = lo[r], *(fv *)(y + r * n + V) = hi[r];
}

#define ROWS(L)                                                                                       \
    switch (mr) {                                                                                     \
    case 1: tile(L, xm, k, 1, pq, ym, n); break;                                                      \
    case 2: tile(L, xm, k, 2, pq, ym, n); break;                                                      \
    case 3: tile(L, xm, k, 3, pq, ym, n); break;                                                      \
    case 4: tile(L, xm, k, 4, pq, ym, n); break;                                                      \
    case 5: tile(L, xm, k, 5, pq, ym, n); break;                                                      \
    case 6: tile(L, xm, k, 6, pq, ym, n); break;                                                      \
    case 7: tile(L, xm, k, 7, pq, ym, n); break;                                                      \
    default: tile(L, xm, k, 8, pq, ym, n);                                                            \
    }

/* y [rows, n] = x [rows, k] W^T, W packed in panels of P outputs ([n / P, k, P] in `layout`) */
static void linear(int layout, const float *x, int64_t rows, const void *w, int64_t n, int64_t k, float *y) {
    const size_t elem = layout == FP32 ? 4 : 2;
    for (int64_t q = 0; q < n / P; q++)
        for (int64_t m = 0; m < rows; m += 8) {
            const int mr = rows - m < 8 ? (int)(rows - m) : 8;
            const float *xm = x + m * k;
            const void *pq = (const char *)w + (size_t)(q * k * P) * elem;
            float *ym = y + m * n + q * P;
            if (layout == FP32) {
                ROWS(FP32)
            } else if (layout == BF16) {
                ROWS(BF16)
            } else {
                ROWS(PAIRS)
            }
        }
}

/* w [n, k] (bf16-representable floats) packed in `layout` */
static void *pack(int layout, const float *w, int64_t n, int64_t k) {
    const size_t elem = layout == FP32 ? 4 : 2, bytes = (size_t)(n * k) * elem;
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    for (int64_t q = 0; q < n / P; q++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < P; j++) {
                const float v = w[(q * P + j) * k + i];
                const int64_t at = (q * k + i) * P;
                if (layout == FP32) ((float *)p)[at + j] = v;
                else if (layout == BF16) ((uint16_t *)p)[at + j] = bf16_cut(v);
                else /* word j: column j high, column V + j low */
                    ((uint16_t *)p)[at + (j % V) * 2 + (j < V ? 1 : 0)] = bf16_cut(v);
            }
    return p;
}

/* every layout gives float32's output for bf16-representable weights (the sums' order is the same) */
static int agree(void) {
    const int64_t n = 64, k = 48, rows = 5;
    float w[64 * 48], x[5 * 48], want[5 * 64], got[5 * 64];
    srand(1);
    for (int i = 0; i < n * k; i++) {
        const uint32_t u = (uint32_t)bf16_cut((float)rand() / RAND_MAX - 0.5f) << 16;
        memcpy(&w[i], &u, 4);
    }
    for (int i = 0; i < rows * k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    void *p32 = pack(FP32, w, n, k);
    linear(FP32, x, rows, p32, n, k, want);
    for (int64_t m = 0; m < rows; m++) /* and float32 is y = x W^T */
        for (int64_t o = 0; o < n; o++) {
            double s = 0;
            for (int64_t i = 0; i < k; i++) s += (double)x[m * k + i] * w[o * k + i];
            if (fabs(s - want[m * n + o]) > 1e-4) return 0;
        }
    for (int layout = BF16; layout <= PAIRS; layout++) {
        void *p = pack(layout, w, n, k);
        linear(layout, x, rows, p, n, k, got);
        free(p);
        if (memcmp(want, got, sizeof got)) return 0;
    }
    free(p32);
    return 1;
}

int main(int argc, char **argv) {
    const int rows = argc > 1 ? atoi(argv[1]) : 1, reps = argc > 3 ? atoi(argv[3]) : 20;
    const int layers = argc > 4 ? atoi(argv[4]) : 30; /* fewer: no LM head either (the tests' short run) */
    const char *name = argc > 2 ? argv[2] : "fp32";
    const int layout = !strcmp(name, "bf16p") ? PAIRS : !strcmp(name, "bf16") ? BF16 : FP32;
    if (rows < 1 || rows > 64 || reps < 1 || layers < 1 || layers > 30)
        return fprintf(stderr, "ROWS 1..64, REPS >= 1, LAYERS 1..30\n"), 2;
    if (!agree()) return fprintf(stderr, "the bf16 layouts disagree with float32\n"), 1;
    /* per layer: qkv, o, gate_up, down ([n, k]); then the tied LM head */
    const int64_t shapes[5][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {49152, 576}};
    const size_t elem = layout == FP32 ? 4 : 2;
    void *w[121];
    int64_t shape_of[121];
    int count = 0;
    for (int l = 0; l <= (layers == 30 ? 30 : layers - 1); l++)
        for (int s = 0; s < (l == 30 ? 1 : 4); s++, count++) {
            shape_of[count] = l == 30 ? 4 : s;
            const size_t bytes = (size_t)(shapes[shape_of[count]][0] * shapes[shape_of[count]][1]) * elem;
            w[count] = aligned_alloc(64, (bytes + 63) / 64 * 64);
            memset(w[count], 0x3c, bytes); /* ~0.01 in either format: finite sums */
        }
    float *x = aligned_alloc(64, 64 * 1536 * 4), *y = aligned_alloc(64, 64 * 49152 * 4);
    for (int i = 0; i < 64 * 1536; i++) x[i] = (float)(i % 7) * 0.01f;
    double best = 1e9, bytes = 0;
    for (int c = 0; c < count; c++) bytes += (double)(shapes[shape_of[c]][0] * shapes[shape_of[c]][1]) * elem;
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        for (int c = 0; c < count; c++)
            linear(layout, x, rows, w[c], shapes[shape_of[c]][0], shapes[shape_of[c]][1], y);
        const double t = (now_s() - t0) * 1e3;
        best = t < best ? t : best;
    }
    printf("%s rows %d: best %.2f ms a step, %.0f MB of weights (%.1f GB/s)\n", name, rows, best, bytes / 1e6,
           bytes / (best * 1e-3) / 1e9);
    return 0;
}
