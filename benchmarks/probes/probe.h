/* What the probes in this folder share: a monotonic clock and bf16 <-> float32 by bits (a bf16 is a
 * float32's upper 16 bits; cutting rounds toward zero, which is all the probes' checks need). */
#ifndef KVPACT_PROBE_H
#define KVPACT_PROBE_H
#include <stdint.h>
#include <string.h>
#include <time.h>

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static inline uint16_t bf16_cut(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif
