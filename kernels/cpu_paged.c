/* The CPU worker's C kernels (fp32): paged KV cache write and decode, reading each sequence's blocks
 * where they lie, and the linear layers of small batches (decode steps of a few sequences). The KV cache
 * holds float32 or bfloat16 (`cache_bf16`); queries, new K/V rows, sums and outputs are float32.
 *
 * Built at worker startup by kernels/cpu_paged.py (cc -O3 -march=native, no torch headers) and called
 * through ctypes with raw pointers; the layouts are kernels/reference.py's:
 *   key_cache, value_cache  [num_blocks, block_size, kv_heads, head_dim] float or bf16, contiguous
 *   block_tables            [num_seqs, table_stride] int32
 *   slot                    block_id * block_size + offset; < 0 = skip
 * Query head h reads KV head h / (q_heads / kv_heads) (GQA).
 *
 * Work is split across `num_threads` POSIX threads (decode: over sequences, balanced by tokens; linear:
 * over output features) where it is worth a hand-off, on a pool of threads kept between calls (run_chunks);
 * no OpenMP runtime, so nothing competes with torch's own thread pool between calls.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512BF16__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* A bfloat16 is a float32's upper 16 bits: widened exactly by a shift. */
static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* q . k over dim elements of a cache row (float32, or bfloat16 where bf16), and o += p * v: one typed
 * loop each, so both vectorize (a loop reading through one pointer of either type did not). */
static inline __attribute__((always_inline)) float dot_kv(const float *restrict q, const void *k,
                                                          const int64_t dim, const int bf16) {
    float acc = 0.0f;
    if (bf16) {
        const uint16_t *restrict kh = (const uint16_t *)k;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < dim; d++) acc += q[d] * from_bf16(kh[d]);
    } else {
        const float *restrict kh = (const float *)k;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < dim; d++) acc += q[d] * kh[d];
    }
    return acc;
}

static inline __attribute__((always_inline)) void axpy_kv(float *restrict o, const float p, const void *v,
                                                          const int64_t dim, const int bf16) {
    if (bf16) {
        const uint16_t *restrict vh = (const uint16_t *)v;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] += p * from_bf16(vh[d]);
    } else {
        const float *restrict vh = (const float *)v;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] += p * vh[d];
    }
}

/* A float32 rounded to bfloat16 as torch's `.to(torch.bfloat16)` rounds it (to nearest, ties to even),
 * so a row written here equals the same row written by torch, but for a NaN's bits (a NaN here is
 * 0x7FC0). Tested in integers: -ffinite-math-only would fold a float NaN test away. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element `index` of a cache of float32 (4 bytes) or bfloat16 (2). */
static inline const char *kv_element(const void *cache, int64_t index, const int bf16) {
    return (const char *)cache + index * (bf16 ? 2 : 4);
}

/* n float32 values into a cache row at element `index`, rounded where the cache is bfloat16. */
static void kv_store(void *cache, int64_t index, const float *src, int64_t n, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + index, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)cache + index;
    for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
}

/* Copies each token's K/V row (kv_heads * head_dim floats) into its slot. Rows of key/value are
 * `key_stride` / `value_stride` floats apart (a token's kv_heads x head_dim block is contiguous). */
void kvp_write_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                   void *key_cache, void *value_cache, const int64_t *slots, int64_t num_tokens, int64_t row,
                   int64_t cache_bf16) {
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        kv_store(key_cache, slot * row, key + t * key_stride, row, (int)cache_bf16);
        kv_store(value_cache, slot * row, value + t * value_stride, row, (int)cache_bf16);
    }
}

/* e^x for x <= 0 (softmax after subtracting the max; silu_mul's e^-|x|), relative error ~1e-7 (Cephes'
 * expf polynomial).
 * Written out so the loops using it vectorize without -ffast-math: a library built with -ffast-math
 * turns on flush-to-zero for the whole process when it is loaded (denormals would read as 0). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* a[i] = SiLU(g[i]) * g[i + n] (a gate/up projection's row: gate, then up). SiLU(x) = x * sigmoid(x),
 * the sigmoid from e = e^-|x| (never overflows): 1 / (1 + e) for x >= 0, e / (1 + e) below. It
 * vectorizes, where a call to expf per element did not: 0.19 -> 0.017 ms for 32 rows of 1,536, best
 * of 50 (a one-off probe, the CFLAGS of cpu_paged.py); in a 32-sequence decode step's perf profile the
 * expf calls and this loop were ~3% of the samples, on the step thread alone (docs/performance.md,
 * "What is outside the matmuls at 32 sequences"). */
static void silu_mul(const float *restrict g, int64_t n, float *restrict a) {
    const float *restrict u = g + n;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], e = exp_nonpositive(x > 0.0f ? -x : x);
        a[i] = x * (x > 0.0f ? 1.0f : e) / (1.0f + e) * u[i];
    }
}

enum { MAX_THREADS = 64 };

/* How many threads to split `items` over: one while `work` is below `worth` (handing a job to a pool
 * thread costs about a microsecond when it is spinning, tens when it sleeps), else num_threads, at most
 * one per item and MAX_THREADS. */
static int64_t thread_count(int64_t work, int64_t worth, int64_t items, int64_t num_threads) {
    int64_t threads = work < worth ? 1 : num_threads;
    if (threads > items) threads = items;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return threads < 1 ? 1 : threads;
}

/* Runs fn(job, c) for every chunk c of a call on up to `threads` threads: the caller's and the pool's,
 * each taking the next chunk until none is left, so a thread the OS holds back (the cores are shared
 * with the router, a client, another worker) leaves its share to the others instead of stalling the
 * call at a barrier. The pool's threads are kept between calls: starting a thread per call cost 43-53
 * us on this VM, and a decode step makes over a hundred calls a few microseconds apart; waking a
 * sleeping one costs about as much (a futex and an idle vCPU's wake-up). So a pool thread that took
 * part in a call, and a caller waiting for chunks still running, spin for up to SPIN_NS before
 * sleeping: the gaps inside a step are caught, and between steps nothing spins (like OpenMP's own
 * threads, for a far shorter time). One caller at a time uses the pool; a second at the same moment
 * (another engine's step thread) runs its chunks on its own thread, the cores being the first's.
 *
 * Invariant: a chunk is taken only by a compare-and-swap on the ticket, which holds the call's
 * generation, helper count, chunk count and next chunk together; the caller writes the next call's
 * fn and job only after every chunk of this one finished, so a thread that took a chunk read this
 * call's. */
enum { SPIN_NS = 50000, CHUNKS_PER_THREAD = 4, MAX_CHUNKS = CHUNKS_PER_THREAD * MAX_THREADS };
typedef void (*ChunkFn)(void *job, int64_t chunk);

#define TICKET(gen, helpers, chunks, next) \
    (((uint64_t)(gen) << 40) | ((uint64_t)(helpers) << 32) | ((uint64_t)(chunks) << 16) | (uint64_t)(next))
#define TICKET_GEN(t) ((t) >> 40)
#define TICKET_HELPERS(t) (((t) >> 32) & 0xff)
#define TICKET_CHUNKS(t) (((t) >> 16) & 0xffff)
#define TICKET_NEXT(t) ((t) & 0xffff)

typedef struct {
    pthread_mutex_t busy; /* held by the caller whose chunks the pool runs */
    pthread_mutex_t lock; /* with wake and done: the sleeping side of ticket and finished */
    pthread_cond_t wake, done;
    _Atomic uint64_t ticket;     /* TICKET(generation, pool threads taking part, chunks, next chunk) */
    _Atomic int64_t finished;    /* this call's chunks done */
    _Atomic(ChunkFn) fn;         /* this call's */
    void *_Atomic job;           /* this call's */
    uint64_t born[MAX_THREADS];  /* the generation before a pool thread's first call */
    int64_t started;             /* pool threads running: indices 1..started */
} Pool;

#define POOL_INIT                                                                                         \
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,                      \
     PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, {0}, 0}
static Pool pool = POOL_INIT;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* A forked child has none of its parent's threads: it starts its own pool when it first needs one. */
static void pool_after_fork(void) { pool = (Pool)POOL_INIT; }

static void pool_register_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Takes and runs chunks of generation gen until none is left. */
static void take_chunks(uint64_t gen) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if (TICKET_GEN(t) != gen || TICKET_NEXT(t) >= TICKET_CHUNKS(t)) return;
        ChunkFn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        void *job = atomic_load_explicit(&pool.job, memory_order_relaxed);
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(job, (int64_t)TICKET_NEXT(t));
        if (atomic_fetch_add_explicit(&pool.finished, 1, memory_order_acq_rel) + 1 ==
            (int64_t)TICKET_CHUNKS(t)) { /* the last: the caller may be asleep */
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

static void *pool_thread(void *arg) {
    const uint64_t index = (uint64_t)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    uint64_t seen = pool.born[index];
    pthread_mutex_unlock(&pool.lock);
    int spin = 0; /* only after taking part: a call with fewer helpers leaves the others asleep */
    for (;;) {
        uint64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        const int64_t until = spin ? now_ns() + SPIN_NS : 0;
        for (int i = 1; spin && TICKET_GEN(t) == seen; i++) {
            cpu_relax();
            if (i % 64 == 0 && now_ns() > until) break;
            t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        }
        if (TICKET_GEN(t) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (TICKET_GEN(t = atomic_load(&pool.ticket)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = TICKET_GEN(t);
        spin = index <= TICKET_HELPERS(t);
        if (spin) take_chunks(seen);
    }
    return NULL;
}

static void run_chunks(ChunkFn fn, void *job, int64_t chunks, int64_t threads) {
    if (threads > chunks) threads = chunks;
    if (threads > 1) pthread_once(&pool_once, pool_register_fork);
    if (threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) { /* or the cores are another caller's */
        for (int64_t c = 0; c < chunks; c++) fn(job, c);
        return;
    }
    const uint64_t gen = (TICKET_GEN(atomic_load(&pool.ticket)) + 1) & 0xffffff;
    while (pool.started < threads - 1) {
        pthread_attr_t attr;
        pthread_t tid;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_mutex_lock(&pool.lock);
        pool.born[pool.started + 1] = TICKET_GEN(atomic_load(&pool.ticket));
        pthread_mutex_unlock(&pool.lock);
        const int ok = pthread_create(&tid, &attr, pool_thread, (void *)(intptr_t)(pool.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break; /* fewer helpers: the others take their chunks */
        pool.started++;
    }
    const int64_t helpers = pool.started < threads - 1 ? pool.started : threads - 1;
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.job, job, memory_order_relaxed);
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.ticket, TICKET(gen, helpers, chunks, 0), memory_order_release);
    pthread_mutex_lock(&pool.lock); /* wakes the helpers past their spin */
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_chunks(gen);
    const int64_t until = now_ns() + SPIN_NS;
    for (int i = 1; atomic_load_explicit(&pool.finished, memory_order_acquire) < chunks; i++) {
        cpu_relax();
        if (i % 64 == 0 && now_ns() > until) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.finished) < chunks) pthread_cond_wait(&pool.done, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
            break;
        }
    }
    pthread_mutex_unlock(&pool.busy);
}

typedef struct {
    const float *query;  /* [num_seqs, q_heads, head_dim], rows `query_stride` floats apart per seq */
    int64_t query_stride;
    const void *key_cache, *value_cache; /* float32, or bfloat16 where cache_bf16 */
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *context_lens;
    int64_t num_seqs, q_heads, kv_heads, head_dim, block_size;
    float scale;
    int cache_bf16;
    float *out; /* [num_seqs, q_heads, head_dim] contiguous */
    int64_t bounds[MAX_CHUNKS + 1]; /* chunk c: sequences bounds[c] .. bounds[c + 1] */
    _Atomic int status;             /* 0 ok, 1 out of memory */
} DecodeJob;

/* Block b + 1 of a sequence's table where it does not lie right after block b in the pool, else NULL.
 * A pool in use hands a sequence scattered blocks (its prompt's from the free queue, then one per
 * block_size decoded tokens); the CPU's prefetcher follows a stream only through contiguous memory, so
 * every jump waited on memory. Asking for the next block's rows while this one is read (prefetch_row:
 * one row ahead per row read, into L2) hides that: K/V read from memory at random blocks went from
 * 0.51-0.55x to 0.89-1.02x the eager slots' speed; contiguous blocks are left to the hardware; into L1
 * (locality 3) it reached only 0.65-0.69x (`python -m benchmarks.decode_attention --placement random`,
 * docs/performance.md "Scattered blocks prefetched"). */
static inline const char *scattered_next(const void *pool, const int32_t *table, int64_t b,
                                         int64_t num_blocks, int64_t block_bytes) {
    if (b + 1 >= num_blocks || table[b + 1] == table[b] + 1) return NULL;
    return (const char *)pool + (int64_t)table[b + 1] * block_bytes;
}

static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t f = 0; f < bytes; f += 64) __builtin_prefetch(row + f, 0, 2);
}

/* All query heads of one sequence: each block's rows are read once, front to back, for every KV head
 * (a block is contiguous, so the reads stream; where the next block lies elsewhere, its rows are
 * prefetched meanwhile). scores holds q_heads x ctx floats. Inlined per head size and cache dtype
 * (decode_seq), so the common ones run with a constant trip count (measured: 10% faster) and a bf16
 * cache's widening (a shift) vectorizes with the loads. */
static inline __attribute__((always_inline)) void decode_seq_dim(const DecodeJob *j, int64_t seq,
                                                                 float *scores, const int64_t dim,
                                                                 const int bf16) {
    const int64_t q_heads = j->q_heads, kv_heads = j->kv_heads, group = q_heads / kv_heads;
    const int64_t bs = j->block_size, row = kv_heads * dim, row_bytes = row * (bf16 ? 2 : 4);
    const int64_t ctx = j->context_lens[seq], blocks = (ctx + bs - 1) / bs;
    const int32_t *table = j->block_tables + seq * j->table_stride;
    const float *q = j->query + seq * j->query_stride;
    float *out = j->out + seq * q_heads * dim;

    /* scores[h * ctx + t] = q_h . k_t[h / group] * scale */
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const char *k = kv_element(j->key_cache, (int64_t)table[start / bs] * bs * row, bf16);
        const char *next = scattered_next(j->key_cache, table, start / bs, blocks, bs * row_bytes);
        for (int64_t i = 0; i < n; i++) {
            if (next) prefetch_row(next + i * row_bytes, row_bytes);
            for (int64_t g = 0; g < kv_heads; g++) {
                const void *kh = kv_element(k, g * dim, bf16);
                for (int64_t h = g * group; h < (g + 1) * group; h++)
                    scores[h * ctx + start + i] = dot_kv(q + h * dim, kh, dim, bf16) * j->scale;
            }
            k += row_bytes;
        }
    }
    /* softmax per query head */
    for (int64_t h = 0; h < q_heads; h++) {
        float *s = scores + h * ctx;
        float m = s[0];
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < ctx; t++) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < ctx; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
    }
    memset(out, 0, (size_t)(q_heads * dim) * sizeof(float));
    /* out_h = sum_t p_ht v_t[h / group] */
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const char *v = kv_element(j->value_cache, (int64_t)table[start / bs] * bs * row, bf16);
        const char *next = scattered_next(j->value_cache, table, start / bs, blocks, bs * row_bytes);
        for (int64_t i = 0; i < n; i++) {
            if (next) prefetch_row(next + i * row_bytes, row_bytes);
            for (int64_t g = 0; g < kv_heads; g++) {
                const void *vh = kv_element(v, g * dim, bf16);
                for (int64_t h = g * group; h < (g + 1) * group; h++)
                    axpy_kv(out + h * dim, scores[h * ctx + start + i], vh, dim, bf16);
            }
            v += row_bytes;
        }
    }
}

static void decode_seq(const DecodeJob *j, int64_t seq, float *scores) {
    if (j->cache_bf16) {
        switch (j->head_dim) {
        case 64: decode_seq_dim(j, seq, scores, 64, 1); break;
        case 128: decode_seq_dim(j, seq, scores, 128, 1); break;
        default: decode_seq_dim(j, seq, scores, j->head_dim, 1);
        }
        return;
    }
    switch (j->head_dim) {
    case 64: decode_seq_dim(j, seq, scores, 64, 0); break;
    case 128: decode_seq_dim(j, seq, scores, 128, 0); break;
    default: decode_seq_dim(j, seq, scores, j->head_dim, 0);
    }
}

/* Chunk c: sequences bounds[c] .. bounds[c + 1]. */
static void decode_chunk(void *arg, int64_t c) {
    DecodeJob *j = (DecodeJob *)arg;
    int64_t longest = 1;
    for (int64_t it = j->bounds[c]; it < j->bounds[c + 1]; it++) {
        int64_t ctx = j->context_lens[it];
        longest = ctx > longest ? ctx : longest;
    }
    float *scores = (float *)malloc((size_t)(longest * j->q_heads) * sizeof(float));
    if (scores == NULL) {
        atomic_store(&j->status, 1);
        return;
    }
    for (int64_t it = j->bounds[c]; it < j->bounds[c + 1]; it++) decode_seq(j, it, scores);
    free(scores);
}

/* One query token per sequence attends to its first context_lens[s] (>= 1) cached tokens of a float32
 * cache, or a bfloat16 one where cache_bf16. Returns 0, or 1 when memory could not be had (the output is
 * then incomplete). */
int kvp_decode_f32(const float *query, int64_t query_stride, const void *key_cache, const void *value_cache,
                   const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                   int64_t num_seqs, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                   float scale, float *out, int64_t num_threads, int64_t cache_bf16) {
    int64_t total_tokens = 0;
    for (int64_t s = 0; s < num_seqs; s++) total_tokens += context_lens[s];
    const int64_t threads = thread_count(total_tokens * q_heads * head_dim, 1 << 16, num_seqs, num_threads);
    /* Chunks of CHUNKS_PER_THREAD sequences or more: cut finer, a few long sequences of uneven length
     * left one thread with the longest at the end (4 sequences of 583-1414 tokens: a decode step 0.90x
     * the eager cache's, against 0.97x at one chunk a thread; `python -m benchmarks.reused_pool`). */
    int64_t chunks = num_seqs / CHUNKS_PER_THREAD;
    if (chunks > CHUNKS_PER_THREAD * threads) chunks = CHUNKS_PER_THREAD * threads;
    if (chunks < threads) chunks = threads;
    DecodeJob job = {query, query_stride, key_cache, value_cache, block_tables, table_stride,
                     context_lens, num_seqs, q_heads, kv_heads, head_dim, block_size, scale,
                     (int)cache_bf16, out, {0}, 0};
    /* Balance by tokens: chunk boundaries where the running token count crosses total / chunks. */
    int64_t item = 0, seen = 0;
    for (int64_t c = 0; c < chunks; c++) {
        job.bounds[c] = item;
        const int64_t goal = (total_tokens * (c + 1)) / chunks;
        while (item < num_seqs && (c == chunks - 1 || seen < goal)) seen += context_lens[item++];
    }
    job.bounds[chunks] = item;
    run_chunks(decode_chunk, &job, chunks, threads);
    return atomic_load(&job.status);
}

/* y[m, n] = x[m, :] . w[n, :] + bias[n] for a small batch (rows m up to SMALL_BATCH_ROWS): the weights
 * stream once, each block of 4 weight rows dotted with every row of x while it is in cache, so a batch
 * of a few tokens runs at memory bandwidth where it is all weight reads (measured: torch's matmul, MKL,
 * reached 5-10 GB/s at 1-8 rows on an AMD EPYC, this 20 GB/s and more on one thread). Blocked 4 features
 * x 4 rows: the 16 dot products share each load of 4 weight and 4 input vectors, so from 4 rows up the
 * loop is bound by its multiply-adds, not its loads (docs/performance.md, "Batches of up to 64 rows on
 * the C kernels"; `python -m benchmarks.small_linear` compares it with torch's). */
typedef struct {
    const float *x, *w, *bias; /* x [rows, k], w [n, k], bias [n] or NULL, all contiguous */
    float *y;                  /* [rows, n] contiguous */
    int64_t rows, n, k;
    int64_t chunk_n;        /* output features per chunk */
    int64_t first_n, end_n; /* this chunk's */
} LinearJob;

static inline __attribute__((always_inline)) void linear_features(const LinearJob *j, const int64_t k) {
    const int64_t rows = j->rows, n_total = j->n;
    const float *restrict x = j->x;
    float *restrict y = j->y;
    int64_t n = j->first_n;
    /* Under 4 rows a step is all weight reads and one weight row at a time streams them fastest
     * (measured: 4 features at a time made a batch-1 step's matmuls 1.2x slower). */
    for (; rows >= 4 && n + 4 <= j->end_n; n += 4) {
        const float *restrict w0 = j->w + n * k, *restrict w1 = w0 + k, *restrict w2 = w1 + k,
                             *restrict w3 = w2 + k;
        float b[4];
        for (int q = 0; q < 4; q++) b[q] = j->bias ? j->bias[n + q] : 0.0f;
        int64_t m = 0;
        for (; m + 4 <= rows; m += 4) {
            const float *restrict x0 = x + m * k, *restrict x1 = x0 + k, *restrict x2 = x1 + k,
                                 *restrict x3 = x2 + k;
            float a00 = 0, a01 = 0, a02 = 0, a03 = 0, a10 = 0, a11 = 0, a12 = 0, a13 = 0;
            float a20 = 0, a21 = 0, a22 = 0, a23 = 0, a30 = 0, a31 = 0, a32 = 0, a33 = 0;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)
            for (int64_t i = 0; i < k; i++) {
                const float v0 = x0[i], v1 = x1[i], v2 = x2[i], v3 = x3[i];
                const float u0 = w0[i], u1 = w1[i], u2 = w2[i], u3 = w3[i];
                a00 += v0 * u0; a01 += v0 * u1; a02 += v0 * u2; a03 += v0 * u3;
                a10 += v1 * u0; a11 += v1 * u1; a12 += v1 * u2; a13 += v1 * u3;
                a20 += v2 * u0; a21 += v2 * u1; a22 += v2 * u2; a23 += v2 * u3;
                a30 += v3 * u0; a31 += v3 * u1; a32 += v3 * u2; a33 += v3 * u3;
            }
            float *y0 = y + m * n_total + n, *y1 = y0 + n_total, *y2 = y1 + n_total, *y3 = y2 + n_total;
            y0[0] = a00 + b[0]; y0[1] = a01 + b[1]; y0[2] = a02 + b[2]; y0[3] = a03 + b[3];
            y1[0] = a10 + b[0]; y1[1] = a11 + b[1]; y1[2] = a12 + b[2]; y1[3] = a13 + b[3];
            y2[0] = a20 + b[0]; y2[1] = a21 + b[1]; y2[2] = a22 + b[2]; y2[3] = a23 + b[3];
            y3[0] = a30 + b[0]; y3[1] = a31 + b[1]; y3[2] = a32 + b[2]; y3[3] = a33 + b[3];
        }
        for (; m < rows; m++) { /* the last rows (rows % 4), four features at a time */
            const float *restrict xm = x + m * k;
            float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t i = 0; i < k; i++) {
                const float v = xm[i];
                a0 += v * w0[i]; a1 += v * w1[i]; a2 += v * w2[i]; a3 += v * w3[i];
            }
            float *ym = y + m * n_total + n;
            ym[0] = a0 + b[0]; ym[1] = a1 + b[1]; ym[2] = a2 + b[2]; ym[3] = a3 + b[3];
        }
    }
    for (; n < j->end_n; n++) { /* under 4 rows, or the last features (a thread's share % 4) */
        const float *restrict wr = j->w + n * k;
        const float b = j->bias ? j->bias[n] : 0.0f;
        for (int64_t m = 0; m < rows; m++) {
            const float *restrict xm = x + m * k;
            float a = 0.0f;
#pragma omp simd reduction(+ : a)
            for (int64_t i = 0; i < k; i++) a += xm[i] * wr[i];
            y[m * n_total + n] = a + b;
        }
    }
}

/* Chunk c: output features c * chunk_n .. (c + 1) * chunk_n (a multiple of 4), the last fewer. */
static void linear_chunk(void *arg, int64_t c) {
    LinearJob j = *(const LinearJob *)arg;
    j.first_n = c * j.chunk_n;
    j.end_n = j.first_n + j.chunk_n < j.n ? j.first_n + j.chunk_n : j.n;
    switch (j.k) { /* the common hidden sizes with a constant trip count */
    case 576: linear_features(&j, 576); break;
    case 1536: linear_features(&j, 1536); break;
    case 2048: linear_features(&j, 2048); break;
    case 4096: linear_features(&j, 4096); break;
    default: linear_features(&j, j.k);
    }
}

void kvp_linear_f32(const float *x, int64_t rows, const float *w, const float *bias, int64_t n, int64_t k,
                    float *y, int64_t num_threads) {
    /* Split only work of 512 KB of weights at one row and more, counting every row (at many rows the
     * multiply-adds are the work): below it one thread ran faster than two (a pool thread that was
     * spinning takes about a microsecond to start a job). */
    const int64_t threads = thread_count(n * k * rows, 1 << 17, (n + 3) / 4, num_threads);
    const int64_t chunks = threads == 1 ? 1 : CHUNKS_PER_THREAD * threads;
    const int64_t chunk_n = n > 4 * chunks ? ((n + chunks - 1) / chunks + 3) / 4 * 4 : 4;
    LinearJob job = {x, w, bias, y, rows, n, k, chunk_n, 0, 0};
    run_chunks(linear_chunk, &job, (n + chunk_n - 1) / chunk_n, threads);
}

/* The same product on weights laid out for it ("packed"): w [n, k] as panels of PANEL output features,
 * panel p holding w[p * PANEL + j, i] at p * k * PANEL + i * PANEL + j, so a panel streams once from
 * front to back. A tile of up to PANEL_ROWS input rows x one panel keeps its PANEL_ROWS x PANEL sums in
 * registers and adds one outer product per input feature i: the panel's PANEL weights (two vector loads)
 * times each row's x[m, i] (a broadcast), so no sum is ever reduced across a vector and every load feeds
 * PANEL_ROWS multiply-adds. One tile kernel serves every row count, prefill chunks included (measured
 * on an AMD EPYC, one thread, in cache: 105-117 GFLOP/s from 8 rows to 2,048, where the 4 x 4 dot-product
 * blocks above ran 44-78 and torch's matmul 60-103; docs/performance.md, "Packed weights").
 * With AVX-512 a tile is 8 rows x 32 features (16 of the 32 vector registers hold sums); with AVX2 and
 * FMA (16 registers) 6 rows x 16 features (12 sums), BLIS's shape for that ISA: 86-113 GFLOP/s built
 * with -mno-avx512f on the same CPU, where the dot-product blocks ran 52-65. Elsewhere (no AVX2, other
 * architectures) nothing is packed (kvp_panel_width 0) and the [n, k] kernel above runs. */
#if defined(__AVX512F__)
#define PANEL_VECTOR 16
#define PANEL_ROWS 8
#elif defined(__AVX2__) && defined(__FMA__)
#define PANEL_VECTOR 8
#define PANEL_ROWS 6
#endif
#ifdef PANEL_VECTOR
enum { PANEL = 2 * PANEL_VECTOR };
/* aligned(4): a vector read or written at any float's address (loads and stores through it compile to
 * single unaligned vector moves; memcpy into it went through the stack in the AVX2 build) */
typedef float panel_vec __attribute__((vector_size(PANEL_VECTOR * sizeof(float)), aligned(4)));

typedef struct {
    const void *x, *p, *bias; /* x [rows, k], p packed (float32 or bf16 pairs, below), bias [n] or NULL */
    void *y;                  /* [rows, n] */
    int64_t rows, n, k;
    int64_t panel_parts, chunk_panels, chunk_rows; /* chunk c: panels (c % panel_parts) * chunk_panels..,
                                                      rows (c / panel_parts) * chunk_rows.. */
} PackedJob;

static inline __attribute__((always_inline)) void packed_tile(const float *restrict x, const int64_t k,
                                                              const int mr, const float *restrict p,
                                                              const float *bias, float *restrict y,
                                                              const int64_t n) {
    panel_vec lo[8], hi[8]; /* mr <= PANEL_ROWS <= 8 of them used */
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = (panel_vec){0};
    for (int64_t i = 0; i < k; i++) {
        const panel_vec b0 = *(const panel_vec *)(p + i * PANEL);
        const panel_vec b1 = *(const panel_vec *)(p + i * PANEL + PANEL_VECTOR);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * k + i];
            lo[r] += a * b0;
            hi[r] += a * b1;
        }
    }
    const panel_vec c0 = bias ? *(const panel_vec *)bias : (panel_vec){0};
    const panel_vec c1 = bias ? *(const panel_vec *)(bias + PANEL_VECTOR) : (panel_vec){0};
    for (int r = 0; r < mr; r++) {
        *(panel_vec *)(y + r * n) = lo[r] + c0;
        *(panel_vec *)(y + r * n + PANEL_VECTOR) = hi[r] + c1;
    }
}

/* A chunk of a PackedJob (chunk c: its panels and rows, kvp_linear_packed_f32's split) with `tile`, whose
 * x, panels, bias and y are X, P, X and X; a panel is `panel_words` P elements; a tile is at most ROWS
 * rows. A macro, not a function pointer: each case calls the tile with a constant row count, so its
 * sums stay in registers. */
#define PACKED_CHUNK(name, tile, X, P, panel_words, ROWS)                                                      \
    static void name(void *arg, int64_t c) {                                                                  \
        const PackedJob *j = (const PackedJob *)arg;                                                          \
        const int64_t k = j->k, n = j->n, panels = n / PANEL;                                                 \
        const int64_t first_panel = (c % j->panel_parts) * j->chunk_panels;                                   \
        const int64_t first_row = (c / j->panel_parts) * j->chunk_rows;                                      \
        const int64_t end_panel = first_panel + j->chunk_panels < panels ? first_panel + j->chunk_panels : panels; \
        const int64_t end_row = first_row + j->chunk_rows < j->rows ? first_row + j->chunk_rows : j->rows;    \
        for (int64_t q = first_panel; q < end_panel; q++) {                                                   \
            const P *p = (const P *)j->p + q * (panel_words);                                                 \
            const X *bias = j->bias ? (const X *)j->bias + q * PANEL : NULL;                                  \
            X *y = (X *)j->y + q * PANEL;                                                                     \
            const X *x = (const X *)j->x;                                                                     \
            int64_t m = first_row;                                                                            \
            for (; m + (ROWS) <= end_row; m += (ROWS))                                                        \
                tile(x + m * k, k, (ROWS), p, bias, y + m * n, n);                                            \
            x += m * k;                                                                                       \
            y += m * n;                                                                                       \
            switch (end_row - m) {                                                                            \
            case 1: tile(x, k, 1, p, bias, y, n); break;                                                      \
            case 2: if ((ROWS) > 2) tile(x, k, 2, p, bias, y, n); break;                                      \
            case 3: if ((ROWS) > 3) tile(x, k, 3, p, bias, y, n); break;                                      \
            case 4: if ((ROWS) > 4) tile(x, k, 4, p, bias, y, n); break;                                      \
            case 5: if ((ROWS) > 5) tile(x, k, 5, p, bias, y, n); break;                                      \
            case 6: if ((ROWS) > 6) tile(x, k, 6, p, bias, y, n); break;                                      \
            case 7: if ((ROWS) > 7) tile(x, k, 7, p, bias, y, n); break;                                      \
            default: break;                                                                                   \
            }                                                                                                 \
        }                                                                                                     \
    }

PACKED_CHUNK(packed_chunk, packed_tile, float, float, k * PANEL, PANEL_ROWS)

/* bfloat16 weights (a `--dtype bfloat16` model's), packed in pairs: panel p holds, for each pair of
 * input features (2i, 2i + 1), one 32-bit word per output feature j: w[p * PANEL + j, 2i] in its low
 * half, w[.., 2i + 1] in its high half (k even, so every pair is whole). Half the bytes of float32 for
 * the same tile: a decode step of a few rows is the weights' reads. x, the bias and y are bfloat16
 * too (the model's activations); the sums are float32, rounded once to bfloat16 at the end, as torch's
 * bf16 matmul rounds them. With AVX512-BF16 one instruction (vdpbf16ps) adds a pair's two products to
 * each sum; elsewhere the two halves widen to float32 by a shift and a mask (no shuffle) for two
 * multiply-adds. Either way the products of normal values are exact in float32 (8-bit significands),
 * and the odd feature's is added first, as vdpbf16ps adds it; the two builds agree bit for bit but
 * where vdpbf16ps flushes a subnormal input or sum to zero (below 1.2e-38, far under any weight's or
 * activation's scale). */
typedef uint32_t pair_vec __attribute__((vector_size(PANEL_VECTOR * sizeof(uint32_t)), aligned(4)));

static inline __attribute__((always_inline)) panel_vec pair_madd(panel_vec sum, const pair_vec w, const uint32_t xp) {
#if defined(__AVX512BF16__) && PANEL_VECTOR == 16
    return (panel_vec)_mm512_dpbf16_ps((__m512)sum, (__m512bh)w, (__m512bh)_mm512_set1_epi32((int)xp));
#else
    sum += from_bf16((uint16_t)(xp >> 16)) * (panel_vec)(w & 0xffff0000u);
    return sum + from_bf16((uint16_t)xp) * (panel_vec)(w << 16);
#endif
}

static inline __attribute__((always_inline)) void packed_tile_bf16(const uint16_t *restrict x, const int64_t k,
                                                                   const int mr, const uint32_t *restrict p,
                                                                   const uint16_t *bias, uint16_t *restrict y,
                                                                   const int64_t n) {
    panel_vec lo[8], hi[8]; /* mr <= PANEL_ROWS <= 8 of them used */
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = (panel_vec){0};
    for (int64_t i = 0; i < k / 2; i++) {
        const pair_vec w0 = *(const pair_vec *)(p + i * PANEL);
        const pair_vec w1 = *(const pair_vec *)(p + i * PANEL + PANEL_VECTOR);
        for (int r = 0; r < mr; r++) {
            uint32_t xp; /* x[r, 2i] low, x[r, 2i + 1] high: the weights' order */
            memcpy(&xp, x + r * k + 2 * i, sizeof xp);
            lo[r] = pair_madd(lo[r], w0, xp);
            hi[r] = pair_madd(hi[r], w1, xp);
        }
    }
    float c[PANEL] = {0};
    if (bias)
        for (int j = 0; j < PANEL; j++) c[j] = from_bf16(bias[j]);
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < PANEL_VECTOR; j++) {
            y[r * n + j] = to_bf16(lo[r][j] + c[j]);
            y[r * n + PANEL_VECTOR + j] = to_bf16(hi[r][j] + c[PANEL_VECTOR + j]);
        }
}

PACKED_CHUNK(packed_chunk_bf16, packed_tile_bf16, uint16_t, uint32_t, k / 2 * PANEL, PANEL_ROWS)

/* Q4_1 weights (the bundled GGUF's 4-bit blocks: for output j and each run of QUANT_BLOCK input features,
 * w = d_j * q + m_j, q in 0..15), kept as 4 bits where float32 holds exactly those values
 * (kernels/cpu_paged.py `pack_q4` checks every weight). A panel is k / QUANT_BLOCK blocks of
 * Q4_BLOCK_BYTES: for each of the block's input features i, PANEL_VECTOR bytes, byte j holding output
 * j's q in its low nibble and output PANEL_VECTOR + j's in its high one; then the block's d [PANEL] and
 * m [PANEL], float32 (the file's float16, widened exactly). Six bits a weight against float32's 32: a
 * decode step of a few rows, which is the weights' reads in float32, becomes a step of the tile's
 * arithmetic. Each block's sum is factored, sum_i x_i (d q_i + m) = d (sum_i x_i q_i) + m (sum_i x_i):
 * the same two multiply-adds a weight as float32 (on q, exact small integers) plus its nibble widened,
 * and two a block. So the sums round in another order than float32's tile on the same weights (within
 * float32 rounding; tests/kernels/test_cpu_paged.py), the same order at every row count and thread
 * count. Measured (benchmarks/probes/q4_panels.c, one thread, SmolLM2-135M's 30 layers, AMD EPYC with
 * AVX-512): 4.6 / 9.2 / 16.1 ms a step at 1 / 3 / 6 rows against float32's 18.9 / 17.2 / 17.3, and slower
 * from 8 rows (the widening per tile; the multiply-adds then bound both), so decode steps of at most
 * QUANT_MAX_ROWS rows take it (kvp_decode_layers_f32) and everything else the float32 panels. */
#define QUANT_BLOCK 32
enum { Q4_BLOCK_BYTES = QUANT_BLOCK * PANEL_VECTOR + 2 * PANEL * (int)sizeof(float) };
#if PANEL_VECTOR == 16
#define QUANT_ROWS 6 /* 4 x 6 sums in 32 registers */
#define QUANT_MAX_ROWS 6
typedef int32_t nibble_vec __attribute__((vector_size(64))); /* PANEL_VECTOR bytes widened */
static inline nibble_vec widen_bytes(const uint8_t *b) {
    return (nibble_vec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
}
static inline nibble_vec widen_signed(const int8_t *b) {
    return (nibble_vec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b));
}
static inline panel_vec vfma(panel_vec a, panel_vec b, panel_vec c) {
    return (panel_vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#else
#define QUANT_ROWS 2 /* 4 x 2 sums in 16 registers */
#define QUANT_MAX_ROWS 2 /* not measured: a tile of 2 rows widens the nibbles once per 2 */
typedef int32_t nibble_vec __attribute__((vector_size(32)));
static inline nibble_vec widen_bytes(const uint8_t *b) {
    return (nibble_vec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
}
static inline nibble_vec widen_signed(const int8_t *b) {
    return (nibble_vec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b));
}
static inline panel_vec vfma(panel_vec a, panel_vec b, panel_vec c) {
    return (panel_vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#endif

/* sum of x[0..QUANT_BLOCK), in one fixed order */
static inline float block_sum(const float *x) {
    panel_vec v = *(const panel_vec *)x;
    for (int j = PANEL_VECTOR; j < QUANT_BLOCK; j += PANEL_VECTOR) v += *(const panel_vec *)(x + j);
    float s = 0.0f;
    for (int l = 0; l < PANEL_VECTOR; l++) s += v[l];
    return s;
}

/* Q8_0 weights (the bundled GGUF's token embedding, which is its tied LM head: w = d_j * q, q an int8,
 * per output j and QUANT_BLOCK input features), kept as 8 bits where float32 holds exactly those values
 * (`pack_q8`). A block: for each input feature, PANEL int8s (byte j: output j), then d [PANEL] float32.
 * Nine bits a weight; the sums factored as Q4_1's, d (sum_i x_i q_i), one multiply-add a block. */
enum { Q8_BLOCK_BYTES = QUANT_BLOCK * PANEL + PANEL * (int)sizeof(float) };

/* A tile on Q4_1 (q8 0) or Q8_0 (q8 1) panels: each input feature's q for outputs [0, PANEL_VECTOR) and
 * [PANEL_VECTOR, PANEL) widened to two vectors, summed against x per block, then per block
 * lo += d * sum(x q), and + m * sum(x) for Q4_1. */
static inline __attribute__((always_inline)) void packed_tile_quant(const float *restrict x, const int64_t k,
                                                                    const int mr, const uint8_t *restrict p,
                                                                    const float *bias, float *restrict y,
                                                                    const int64_t n, const int q8) {
    const int64_t feature_bytes = q8 ? PANEL : PANEL_VECTOR; /* one input feature's q of the panel */
    const int64_t block_bytes = q8 ? Q8_BLOCK_BYTES : Q4_BLOCK_BYTES;
    panel_vec lo[QUANT_ROWS], hi[QUANT_ROWS];
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = (panel_vec){0};
    for (int64_t b = 0; b < k / QUANT_BLOCK; b++) {
        const uint8_t *blk = p + b * block_bytes;
        const float *xb = x + b * QUANT_BLOCK;
        panel_vec qlo[QUANT_ROWS], qhi[QUANT_ROWS];
        for (int r = 0; r < mr; r++) qlo[r] = qhi[r] = (panel_vec){0};
        for (int i = 0; i < QUANT_BLOCK; i++) {
            const uint8_t *row = blk + i * feature_bytes;
            panel_vec q0, q1;
            if (q8) {
                q0 = __builtin_convertvector(widen_signed((const int8_t *)row), panel_vec);
                q1 = __builtin_convertvector(widen_signed((const int8_t *)row + PANEL_VECTOR), panel_vec);
            } else {
                const nibble_vec u = widen_bytes(row);
                q0 = __builtin_convertvector(u & 15, panel_vec);
                q1 = __builtin_convertvector(u >> 4, panel_vec);
            }
            for (int r = 0; r < mr; r++) {
                const float a = xb[r * k + i];
                qlo[r] += a * q0;
                qhi[r] += a * q1;
            }
        }
        const float *dm = (const float *)(blk + QUANT_BLOCK * feature_bytes);
        const panel_vec d0 = *(const panel_vec *)dm, d1 = *(const panel_vec *)(dm + PANEL_VECTOR);
        for (int r = 0; r < mr; r++) {
            lo[r] = vfma(d0, qlo[r], lo[r]);
            hi[r] = vfma(d1, qhi[r], hi[r]);
            if (!q8) {
                const panel_vec s = (panel_vec){0} + block_sum(xb + r * k);
                lo[r] = vfma(s, *(const panel_vec *)(dm + PANEL), lo[r]);
                hi[r] = vfma(s, *(const panel_vec *)(dm + PANEL + PANEL_VECTOR), hi[r]);
            }
        }
    }
    const panel_vec c0 = bias ? *(const panel_vec *)bias : (panel_vec){0};
    const panel_vec c1 = bias ? *(const panel_vec *)(bias + PANEL_VECTOR) : (panel_vec){0};
    for (int r = 0; r < mr; r++) {
        *(panel_vec *)(y + r * n) = lo[r] + c0;
        *(panel_vec *)(y + r * n + PANEL_VECTOR) = hi[r] + c1;
    }
}

/* PACKED_CHUNK's tiles (its call has no kind argument) */
static inline __attribute__((always_inline)) void packed_tile_q4(const float *restrict x, const int64_t k,
                                                                 const int mr, const uint8_t *restrict p,
                                                                 const float *bias, float *restrict y,
                                                                 const int64_t n) {
    packed_tile_quant(x, k, mr, p, bias, y, n, 0);
}
static inline __attribute__((always_inline)) void packed_tile_q8(const float *restrict x, const int64_t k,
                                                                 const int mr, const uint8_t *restrict p,
                                                                 const float *bias, float *restrict y,
                                                                 const int64_t n) {
    packed_tile_quant(x, k, mr, p, bias, y, n, 1);
}

PACKED_CHUNK(packed_chunk_q4, packed_tile_q4, float, uint8_t, k / QUANT_BLOCK * Q4_BLOCK_BYTES, QUANT_ROWS)

PACKED_CHUNK(packed_chunk_q8, packed_tile_q8, float, uint8_t, k / QUANT_BLOCK * Q8_BLOCK_BYTES, QUANT_ROWS)
#else
enum { PANEL = 0, Q4_BLOCK_BYTES = 0, Q8_BLOCK_BYTES = 0 };
#define QUANT_MAX_ROWS 0
#endif /* PANEL_VECTOR */

/* The bytes of one Q4_1 and one Q8_0 block of a packed panel (kernels/cpu_paged.py `pack_q4`,
 * `pack_q8`), 0 where nothing packs; and the most rows that take them (kvp_decode_layers_f32, the LM
 * head: kernels/cpu_paged.py `small_rows_linear`). */
int64_t kvp_q4_block_bytes(void) { return Q4_BLOCK_BYTES; }
int64_t kvp_q8_block_bytes(void) { return Q8_BLOCK_BYTES; }
int64_t kvp_quant_max_rows(void) { return Q4_BLOCK_BYTES ? QUANT_MAX_ROWS : 0; }

/* The panel width packed weights use on this build (kvp_linear_packed_f32's), 0 where there is none. */
int64_t kvp_panel_width(void) { return PANEL; }

/* The value of a float16's bits (at most 0x7BFF: positive and finite), exactly. */
static float half_value(const uint32_t bits) {
    if (bits < 0x400) return (float)bits * 0x1p-24f; /* subnormal: bits * 2^-24 */
    const uint32_t u = ((bits >> 10) + 112) << 23 | (bits & 0x3FF) << 13;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The bits of the float16 nearest f >= 0 (ties to even, as torch's .half()); 0x7C00 (infinity) past the
 * largest, 0 for f <= 0. */
static int32_t nearest_half(const float f) {
    if (f <= 0.0f) return 0;
    if (f >= 65520.0f) return 0x7C00;
    if (f < 0x1p-14f) return (int32_t)rintf(f * 0x1p24f); /* subnormal (1024: the smallest normal) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t h = ((u >> 23) - 112) << 10 | (u & 0x7FFFFF) >> 13;
    const uint32_t rest = u & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* a carry into the exponent is right too */
    return (int32_t)h;
}

/* The block search behind kernels/cpu_paged.py `exact_blocks` (its docstring is the contract): for each
 * block of 32 weights w [rows, k] (k a multiple of 32; base and scale [rows, k / 32]), the d that is the
 * float16 nearest its scale or 1-2 float16 steps from it (tried in the order 0, -1, 1, -2, 2) and whole
 * levels in [lowest, highest] with d * level + base == w for every weight of the block; writes them to
 * levels [rows, k] and d [rows, k / 32]. Returns 0 when every block has them, else 1 (at the first
 * block that has none). A float16 times a level of at most 8 bits is exact in float32, so the product and
 * the sum round once however the compiler contracts them, as the gguf package's dequantization did. */
int64_t kvp_exact_blocks(const float *w, int64_t rows, int64_t k, const float *base, const float *scale,
                         int64_t lowest, int64_t highest, int8_t *levels, float *d) {
    static const int32_t steps[] = {0, -1, 1, -2, 2};
    const int64_t num_blocks = rows * (k / 32);
    for (int64_t b = 0; b < num_blocks; b++) {
        const float *block = w + b * 32, m = base[b];
        const int32_t nearest = nearest_half(scale[b]);
        int found = 0;
        for (int s = 0; s < 5 && !found; s++) {
            int32_t bits = nearest + steps[s];
            bits = bits < 0 ? 0 : bits > 0x7BFF ? 0x7BFF : bits;
            const float candidate = half_value((uint32_t)bits);
            int exact = 1;
            for (int i = 0; i < 32; i++) {
                float level = candidate > 0.0f ? rintf((block[i] - m) / candidate) : 0.0f;
                level = level < (float)lowest ? (float)lowest : level > (float)highest ? (float)highest : level;
                exact &= candidate * level + m == block[i];
                levels[b * 32 + i] = (int8_t)level;
            }
            if (exact) {
                d[b] = candidate;
                found = 1;
            }
        }
        if (!found) return 1;
    }
    return 0;
}

#ifdef PANEL_VECTOR
/* Runs `chunk` over a PackedJob: split over panels, and over rows too where there are fewer panels than
 * chunks and 64 rows or more to each part (a prefill chunk on many threads). */
static void run_packed(ChunkFn chunk, const void *x, int64_t rows, const void *packed, const void *bias,
                       int64_t n, int64_t k, void *y, int64_t num_threads) {
    if (rows <= 0 || n <= 0) return;
    const int64_t panels = n / PANEL, row_blocks = (rows + 63) / 64;
    const int64_t threads = thread_count(n * k * rows, 1 << 17, panels * row_blocks, num_threads);
    const int64_t chunks = threads == 1 ? 1 : CHUNKS_PER_THREAD * threads;
    int64_t row_parts = chunks > panels ? (chunks + panels - 1) / panels : 1;
    if (row_parts > row_blocks) row_parts = row_blocks;
    const int64_t chunk_rows = ((rows + row_parts - 1) / row_parts + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
    row_parts = (rows + chunk_rows - 1) / chunk_rows;
    int64_t panel_parts = (chunks + row_parts - 1) / row_parts;
    if (panel_parts > panels) panel_parts = panels;
    const int64_t chunk_panels = (panels + panel_parts - 1) / panel_parts;
    panel_parts = (panels + chunk_panels - 1) / chunk_panels;
    PackedJob job = {x, packed, bias, y, rows, n, k, panel_parts, chunk_panels, chunk_rows};
    run_chunks(chunk, &job, panel_parts * row_parts, threads);
}
#endif

/* y[m, n] = x[m, :] . w[n, :] + bias[n] for any number of rows, w packed (above; n a multiple of
 * kvp_panel_width). Does nothing on a build without panels (the caller asked kvp_panel_width first). */
void kvp_linear_packed_f32(const float *x, int64_t rows, const float *packed, const float *bias, int64_t n,
                           int64_t k, float *y, int64_t num_threads) {
#ifdef PANEL_VECTOR
    run_packed(packed_chunk, x, rows, packed, bias, n, k, y, num_threads);
#else
    (void)x, (void)rows, (void)packed, (void)bias, (void)n, (void)k, (void)y, (void)num_threads;
#endif
}

/* The same in bfloat16: x [rows, k], bias [n] or NULL and y [rows, n] bfloat16, w packed in pairs
 * (above; k even). */
void kvp_linear_packed_bf16(const uint16_t *x, int64_t rows, const uint32_t *packed, const uint16_t *bias,
                            int64_t n, int64_t k, uint16_t *y, int64_t num_threads) {
#ifdef PANEL_VECTOR
    run_packed(packed_chunk_bf16, x, rows, packed, bias, n, k, y, num_threads);
#else
    (void)x, (void)rows, (void)packed, (void)bias, (void)n, (void)k, (void)y, (void)num_threads;
#endif
}

/* The same on Q4_1 panels (above; k a multiple of 32): x [rows, k], bias [n] or NULL and y [rows, n]
 * float32. */
void kvp_linear_packed_q4(const float *x, int64_t rows, const uint8_t *packed, const float *bias, int64_t n,
                          int64_t k, float *y, int64_t num_threads) {
#ifdef PANEL_VECTOR
    run_packed(packed_chunk_q4, x, rows, packed, bias, n, k, y, num_threads);
#else
    (void)x, (void)rows, (void)packed, (void)bias, (void)n, (void)k, (void)y, (void)num_threads;
#endif
}

/* The same on Q8_0 panels (above). */
void kvp_linear_packed_q8(const float *x, int64_t rows, const uint8_t *packed, const float *bias, int64_t n,
                          int64_t k, float *y, int64_t num_threads) {
#ifdef PANEL_VECTOR
    run_packed(packed_chunk_q8, x, rows, packed, bias, n, k, y, num_threads);
#else
    (void)x, (void)rows, (void)packed, (void)bias, (void)n, (void)k, (void)y, (void)num_threads;
#endif
}

/* out[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * weight, per row (x, out [rows, dim] contiguous):
 * one call where torch.rms_norm dispatches about 18 ops (21 us a call at one row, measured). */
void kvp_rms_norm_f32(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *out) {
    for (int64_t m = 0; m < rows; m++) {
        const float *restrict xr = x + m * dim;
        float *restrict o = out + m * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * weight[i];
    }
}

/* The weights and KV pools of one decoder layer (a Llama block: RMSNorm, fused q/k/v projection, RoPE,
 * attention, output projection, residual; RMSNorm, fused gate/up projection, SiLU(gate) * up, down
 * projection, residual). Biases may be NULL. The norms are float32; the projections and their biases
 * are the model's dtype (float32, or bfloat16 packed in pairs: kvp_decode_layers_f32's `packed`). The
 * pools are kvp_decode_f32's (float32, or bfloat16). */
typedef struct {
    const float *input_norm;
    const void *qkv, *qkv_bias, *o, *o_bias;
    const float *post_norm;
    const void *gate_up, *down;
    void *key_cache, *value_cache;
    /* the four projections again as Q4_1 panels (kvp_linear_packed_q4), for steps of at most
       QUANT_MAX_ROWS rows; NULL: none (the float32 ones run every step) */
    const uint8_t *qkv_q4, *o_q4, *gate_up_q4, *down_q4;
} DecoderLayer;

/* How a decoder layer's projections are laid out: [n, k] float32, packed float32, packed bfloat16 pairs
 * (kernels/cpu_paged.py `Layout` holds the same values). */
enum { PLAIN = 0, PACKED_F32 = 1, PACKED_BF16 = 2 };

/* One of a decoder layer's projections, float32 x [rows, k] -> y [rows, n]. On bfloat16 pairs (w and
 * bias the model's bfloat16) x is rounded to bfloat16 (into x16) and the product, bias included and
 * rounded once (into y16), widened back: what the model's bf16 layer does with the same kernel. */
static void projection(const float *x, int64_t rows, const void *w, const uint8_t *w_q4, const void *bias,
                       int64_t n, int64_t k, float *y, int64_t num_threads, int64_t packed, uint16_t *x16,
                       uint16_t *y16) {
#ifdef PANEL_VECTOR
    if (w_q4 != NULL && rows <= QUANT_MAX_ROWS) {
        kvp_linear_packed_q4(x, rows, w_q4, bias, n, k, y, num_threads);
        return;
    }
#else
    (void)w_q4;
#endif
    if (packed == PACKED_BF16) {
        for (int64_t i = 0; i < rows * k; i++) x16[i] = to_bf16(x[i]);
        kvp_linear_packed_bf16(x16, rows, (const uint32_t *)w, (const uint16_t *)bias, n, k, y16, num_threads);
        for (int64_t i = 0; i < rows * n; i++) y[i] = from_bf16(y16[i]);
    } else if (packed == PACKED_F32) {
        kvp_linear_packed_f32(x, rows, w, bias, n, k, y, num_threads);
    } else {
        kvp_linear_f32(x, rows, w, bias, n, k, y, num_threads);
    }
}

static inline int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* A step of `rows` tokens (decodes, and prompt chunks' tokens as rows of their own context) from their
 * token ids to the final hidden states in one call: what the model's Python would do layer by layer
 * with the kernels above, without a dispatch between them (at one row that dispatch was a quarter of
 * the step). Row m: token_ids[m]'s row of `embed` (float32, or bfloat16 where embed_bf16, widened;
 * [vocab, hidden], or packed in panels of embed_panel tokens for a tied LM head: kernels/cpu_paged.py
 * `pack`), rotated at positions[m] (RoPE: angle positions[m] * inv_freq[i] in float32, libm's
 * cosf / sinf; dimension i rotates as x[i] * cos + x[i +- head_dim / 2] * (-+ sin), RotaryEmbedding's
 * layout), its rotated K and its V to slots[m] (rounded to bfloat16 where cache_bf16; a slot < 0 writes
 * nothing), then attending over its first context_lens[m] tokens through its table (kvp_decode_f32's
 * tables); every row's K/V is written before any row attends. `packed`: how the layers' four
 * projections are laid out (PLAIN, PACKED_F32, PACKED_BF16: a bfloat16 model's, whose biases stay
 * bfloat16 and whose norm weights the caller gives as float32; the residual stream and every op
 * between the projections stay float32). x [rows, hidden]: out, the residual stream after the last
 * layer, normed by final_norm (float32 [hidden]) unless it is NULL. Returns 0; 1 when memory could not
 * be had; 2 a token id outside [0, vocab); 3 a slot at or past num_slots; 4 a context_lens under 1
 * (x is then incomplete). */
int kvp_decode_layers_f32(float *x, int64_t rows, const int64_t *token_ids, const int64_t *positions,
                          const void *embed, int64_t embed_bf16, int64_t embed_panel, int64_t vocab,
                          const float *inv_freq,
                          const float *final_norm, const DecoderLayer *layers, int64_t num_layers,
                          int64_t hidden, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                          int64_t intermediate, float eps, float scale, const int64_t *slots, int64_t num_slots,
                          const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                          int64_t block_size, int64_t num_threads, int64_t packed, int64_t cache_bf16) {
    for (int64_t m = 0; m < rows; m++) {
        if (token_ids[m] < 0 || token_ids[m] >= vocab) return 2;
        if (slots[m] >= num_slots) return 3;
        if (context_lens[m] < 1) return 4;
    }
    const int64_t q_size = q_heads * head_dim, kv_size = kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, half = head_dim / 2;
    const int64_t floats = rows * (hidden * 2 + qkv_size + q_size * 2 + intermediate * 3 + head_dim * 2) + kv_size;
    /* bfloat16 pairs: a projection's input and output rounded (the widest of each) */
    const int64_t halves = packed == PACKED_BF16
                               ? rows * (max3(hidden, q_size, intermediate) + max3(qkv_size, hidden, 2 * intermediate))
                               : 0;
    float *buffer = (float *)malloc((size_t)floats * sizeof(float) + (size_t)halves * sizeof(uint16_t));
    if (buffer == NULL) return 1;
    uint16_t *x16 = (uint16_t *)(buffer + floats), *y16 = x16 + rows * max3(hidden, q_size, intermediate);
    float *normed = buffer, *delta = normed + rows * hidden, *qkv = delta + rows * hidden;
    float *query = qkv + rows * qkv_size, *attended = query + rows * q_size;
    float *gate_up = attended + rows * q_size, *act = gate_up + rows * 2 * intermediate;
    float *cos = act + rows * intermediate, *sin = cos + rows * head_dim;
    float *key = sin + rows * head_dim; /* one token's rotated K, before it goes to the cache */
    for (int64_t m = 0; m < rows; m++) {
        float *row = x + m * hidden;
        const int64_t t = token_ids[m];
        if (embed_panel) { /* feature i of token t: in t's panel, embed_panel apart (bf16: in pairs) */
            const int64_t base = t / embed_panel * hidden * embed_panel, lane = t % embed_panel;
            if (embed_bf16) {
                const uint16_t *e = (const uint16_t *)embed + base;
                for (int64_t i = 0; i < hidden; i++) row[i] = from_bf16(e[((i / 2) * embed_panel + lane) * 2 + i % 2]);
            } else {
                const float *e = (const float *)embed + base;
                for (int64_t i = 0; i < hidden; i++) row[i] = e[i * embed_panel + lane];
            }
        } else if (embed_bf16) {
            const uint16_t *e = (const uint16_t *)embed + t * hidden;
            for (int64_t i = 0; i < hidden; i++) row[i] = from_bf16(e[i]);
        } else {
            memcpy(row, (const float *)embed + t * hidden, (size_t)hidden * sizeof(float));
        }
        const float p = (float)positions[m];
        float *c = cos + m * head_dim, *sn = sin + m * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float angle = p * inv_freq[i];
            c[i] = c[i + half] = cosf(angle);
            sn[i + half] = sinf(angle);
            sn[i] = -sn[i + half];
        }
    }
    int status = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecoderLayer *L = &layers[l];
        kvp_rms_norm_f32(x, rows, hidden, L->input_norm, eps, normed);
        projection(normed, rows, L->qkv, L->qkv_q4, L->qkv_bias, qkv_size, hidden, qkv, num_threads, packed, x16,
                   y16);
        for (int64_t m = 0; m < rows; m++) {
            const float *c = cos + m * head_dim, *s = sin + m * head_dim;
            const float *src = qkv + m * qkv_size;
            const int64_t slot = slots[m];
            /* q heads into `query`, k heads into `key` (q and k are adjacent in qkv) */
            const int64_t rotated = slot < 0 ? q_heads : q_heads + kv_heads;
            for (int64_t h = 0; h < rotated; h++) {
                const float *in = src + h * head_dim;
                float *out = h < q_heads ? query + m * q_size + h * head_dim : key + (h - q_heads) * head_dim;
                for (int64_t i = 0; i < half; i++) out[i] = in[i] * c[i] + in[i + half] * s[i];
                for (int64_t i = half; i < head_dim; i++) out[i] = in[i] * c[i] + in[i - half] * s[i];
            }
            if (slot >= 0) {
                kv_store(L->key_cache, slot * kv_size, key, kv_size, (int)cache_bf16);
                kv_store(L->value_cache, slot * kv_size, src + q_size + kv_size, kv_size, (int)cache_bf16);
            }
        }
        status = kvp_decode_f32(query, q_size, L->key_cache, L->value_cache, block_tables, table_stride,
                                context_lens, rows, q_heads, kv_heads, head_dim, block_size, scale, attended,
                                num_threads, cache_bf16);
        if (status) break; /* no score buffer: the attention output is incomplete */
        projection(attended, rows, L->o, L->o_q4, L->o_bias, hidden, q_size, delta, num_threads, packed, x16,
                   y16);
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += delta[i];
        kvp_rms_norm_f32(x, rows, hidden, L->post_norm, eps, normed);
        projection(normed, rows, L->gate_up, L->gate_up_q4, NULL, 2 * intermediate, hidden, gate_up, num_threads,
                   packed, x16, y16);
        for (int64_t m = 0; m < rows; m++)
            silu_mul(gate_up + m * 2 * intermediate, intermediate, act + m * intermediate);
        projection(act, rows, L->down, L->down_q4, NULL, hidden, intermediate, delta, num_threads, packed, x16,
                   y16);
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += delta[i];
    }
    if (status == 0 && final_norm != NULL) {
        kvp_rms_norm_f32(x, rows, hidden, final_norm, eps, normed);
        memcpy(x, normed, (size_t)(rows * hidden) * sizeof(float));
    }
    free(buffer);
    return status;
}
