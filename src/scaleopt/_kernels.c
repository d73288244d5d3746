/*
 * Fused CPU kernels for LAMB, LANS and Adam on contiguous float32 tensors.
 *
 * Plain C with OpenMP, called through ctypes on raw pointers: nothing here depends on a
 * particular torch version. LAMB and LANS run in two passes over memory per tensor:
 *   phase 1 updates the moments and accumulates the squared norms the trust ratios need;
 *   phase 2 recomputes the update from the moments and writes the weights;
 * LANS first reads the gradient once for its norm. The passes alternate direction (see
 * BACKWARDS_BEGIN). LAMB moves about 40 bytes per parameter, LANS about 48, against 28 for
 * Adam. Reductions add float partial sums over blocks into doubles, and the per-element
 * divisions are cut to one (reciprocals of the bias corrections), so the passes stay
 * memory-bound.
 *
 * For bfloat16 parameters with float32 master weights, the *_bf16g variants read the bfloat16
 * gradient directly. The master is either a float32 tensor (phase 2 then also writes the rounded
 * bfloat16 parameter, round to nearest even as torch's conversion) or split (lo != NULL): the
 * bfloat16 parameter holds its upper half and lo[] its lower 16 bits, read and written in place
 * (see split_join), 4 bytes per weight instead of 4 + 2: LAMB then moves about 38 bytes per
 * parameter, LANS about 42.
 *
 * The module is also a (empty) Python extension so that setuptools builds it like one; it uses
 * only the stable ABI of Python 3.10, so one build serves every CPython from 3.10 on.
 */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_num_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
#endif

/* Clones for AVX-512 (x86-64-v4), AVX2 + FMA (x86-64-v3), AVX2, and the baseline, picked at
 * load time by the CPU's features; with -ffp-contract=fast (setup.py) a*b+c becomes one fused
 * multiply-add where the CPU has it. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "avx2", "default")))
#elif defined(__x86_64__)
#define TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define TARGETS
#endif

/* weight-decay modes (LAMB) */
enum { MODE_UPDATE = 0, MODE_DECOUPLED = 1, MODE_L2 = 2 };

/* The arguments of the multi-tensor calls, one struct per tensor and one per call. Their
 * ctypes mirrors are in _native.py; struct_layout() below lets a test compare the two. */

/* What every multi-tensor kernel reads of a tensor. kind: bit 0 = bfloat16 gradient, bit 1 =
 * split master (w the bfloat16 upper halves, low the int16 lower halves); otherwise w is the
 * float32 weight and low an optional bfloat16 copy to write in the same pass. */
#define TENSOR_FIELDS                                                                          \
    void *w;          /* float32 weight, or a split master's bfloat16 upper halves */        \
    const void *g;    /* float32 or bfloat16 gradient */                                     \
    float *m;         /* first moment */                                                     \
    float *v;         /* second moment */                                                    \
    uint16_t *low;    /* see kind; NULL for none */                                          \
    float *step;      /* the step counter (a float32 scalar), incremented */                 \
    int64_t n;        /* elements */                                                         \
    int32_t kind;                                                                              \
    float gmul;       /* the scalar the gradient is taken times */

typedef struct {
    TENSOR_FIELDS
    double lr, wd; /* learning rate, weight decay */
    double gsq;    /* LANS: the gradient's sum of squares when already computed, else < 0 */
    int32_t adapt; /* whether the trust ratio applies */
} LayerwiseTensor;

typedef struct {
    double beta1, beta2, lower, upper;
    float eps, clip_lo, clip_hi; /* element-wise gradient clipping bounds (when clip) */
    int32_t bias_correction, has_lower, has_upper, clip, nthreads;
    int32_t mode;  /* LAMB: the weight-decay mode */
    int32_t moved; /* LANS: decay_moved_weight */
} LayerwiseConfig;

typedef struct {
    TENSOR_FIELDS
    float step_size, bc2_sqrt, wd_l2, decay; /* lr/bc1, sqrt(1-b2^t), L2 decay, 1-lr*wd */
} AdamTensor;

typedef struct {
    float beta1, one_m_b1, beta2, one_m_b2, eps;
    int32_t nesterov, nthreads;
} AdamConfig;

#define FIELD(S, F) offsetof(S, F)
/* sizeof and the field offsets of struct `which` (0: LayerwiseTensor, 1: LayerwiseConfig,
 * 2: AdamTensor, 3: AdamConfig), in declaration order, into out; returns how many. */
int64_t struct_layout(int32_t which, int64_t *out) {
#define TENSOR_OFFSETS(S)                                                                      \
    FIELD(S, w), FIELD(S, g), FIELD(S, m), FIELD(S, v), FIELD(S, low), FIELD(S, step),         \
        FIELD(S, n), FIELD(S, kind), FIELD(S, gmul)
    const int64_t layouts[4][20] = {
        {sizeof(LayerwiseTensor), TENSOR_OFFSETS(LayerwiseTensor), FIELD(LayerwiseTensor, lr),
         FIELD(LayerwiseTensor, wd), FIELD(LayerwiseTensor, gsq), FIELD(LayerwiseTensor, adapt),
         -1},
        {sizeof(LayerwiseConfig), FIELD(LayerwiseConfig, beta1), FIELD(LayerwiseConfig, beta2),
         FIELD(LayerwiseConfig, lower), FIELD(LayerwiseConfig, upper),
         FIELD(LayerwiseConfig, eps), FIELD(LayerwiseConfig, clip_lo),
         FIELD(LayerwiseConfig, clip_hi), FIELD(LayerwiseConfig, bias_correction),
         FIELD(LayerwiseConfig, has_lower), FIELD(LayerwiseConfig, has_upper),
         FIELD(LayerwiseConfig, clip), FIELD(LayerwiseConfig, nthreads),
         FIELD(LayerwiseConfig, mode), FIELD(LayerwiseConfig, moved), -1},
        {sizeof(AdamTensor), TENSOR_OFFSETS(AdamTensor), FIELD(AdamTensor, step_size),
         FIELD(AdamTensor, bc2_sqrt), FIELD(AdamTensor, wd_l2), FIELD(AdamTensor, decay), -1},
        {sizeof(AdamConfig), FIELD(AdamConfig, beta1), FIELD(AdamConfig, one_m_b1),
         FIELD(AdamConfig, beta2), FIELD(AdamConfig, one_m_b2), FIELD(AdamConfig, eps),
         FIELD(AdamConfig, nesterov), FIELD(AdamConfig, nthreads), -1},
    };
#undef TENSOR_OFFSETS
    if (which < 0 || which > 3) return 0;
    int64_t k = 0;
    while (k < 20 && layouts[which][k] >= 0) {
        out[k] = layouts[which][k];
        k++;
    }
    return k;
}

static inline float clampf(float x, float lo, float hi) {
    x = x < lo ? lo : x;
    return x > hi ? hi : x;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u; /* keep NaN a (quiet) NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#define OMP_FOR _Pragma("omp parallel for simd num_threads(nthreads) schedule(static) if (n >= 32768)")

/* Split float32 masters (bfloat16 parameters): see the Adam section below for the layout. */
static inline uint16_t split_high(float w) {
    uint32_t u;
    memcpy(&u, &w, sizeof u);
    return (uint16_t)((u + 0x8000u) >> 16);
}

static inline uint16_t split_low(float w) {
    uint32_t u;
    memcpy(&u, &w, sizeof u);
    return (uint16_t)(u & 0xffffu);
}

static inline float split_join(uint16_t hi, uint16_t lo) {
    /* (hi << 16) + the low half as a signed offset: hi was rounded up when lo >= 0x8000 */
    uint32_t u = ((uint32_t)hi << 16) + (uint32_t)(int32_t)(int16_t)lo;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Reductions run over blocks of RBLOCK elements: within a block the sums are float (vector
 * lanes, a few hundred terms each), and each block's sum is added to a double. That keeps the
 * inner loop in single precision, where converting every term to double would make these
 * memory-bound passes compute-bound, and the result within ~1e-6 relative of a double sum. */
#define RBLOCK 2048
#define BLOCKS_BEGIN(...)                                                                      \
    _Pragma(__VA_ARGS__)                                                                       \
    for (int64_t blk = 0; blk < n; blk += RBLOCK) {                                            \
        const int64_t end = n - blk < RBLOCK ? n : blk + RBLOCK;
#define BLOCKS_END }

/* The passes over a tensor alternate direction (LAMB: phase 1 forwards, phase 2 backwards; LANS:
 * the gradient's norm backwards, phase 1 forwards, phase 2 backwards), so that each thread starts
 * a pass where it ended the one before, on data still in the caches. For a tensor somewhat larger
 * than the last-level cache that saves a good part of a pass's reads, where a pass in the same
 * direction would find none of its data left (the cache evicts the oldest lines first, which it
 * needs first). Backwards means chunk by chunk (up to CHUNK elements), downwards; each chunk
 * upwards, so the hardware prefetchers still see ascending streams. A thread's chunks are the
 * ones it covered in the forward pass, give or take one. */
#define CHUNK 131072
/* This thread's chunks [first, last) of *size elements: each thread gets an equal number of
 * chunks of at most CHUNK elements (multiples of RBLOCK), about n / threads elements in all. */
static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
static inline void thread_chunks(int64_t n, int64_t *size, int64_t *first, int64_t *last) {
    const int id = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t share = round_up((n + nt - 1) / nt, RBLOCK);
    if (share == 0) share = RBLOCK;
    const int64_t per_thread = (share + CHUNK - 1) / CHUNK;
    *size = round_up((share + per_thread - 1) / per_thread, RBLOCK);
    const int64_t chunks = (n + *size - 1) / *size;
    *first = chunks * id / nt;
    *last = chunks * (id + 1) / nt;
}
#define BACKWARDS_BEGIN(...)                                                                   \
    _Pragma(__VA_ARGS__) {                                                                     \
        int64_t size_, first_, last_;                                                          \
        thread_chunks(n, &size_, &first_, &last_);                                             \
        for (int64_t chunk_ = last_ - 1; chunk_ >= first_; chunk_--) {                         \
            const int64_t from = chunk_ * size_, to = n - from < size_ ? n : from + size_;
#define BACKWARDS_END }}

/* An elementwise pass, backwards. */
#define BACKWARDS_FOR(BODY)                                                                    \
    BACKWARDS_BEGIN("omp parallel num_threads(nthreads) if (n >= 32768)")                      \
        _Pragma("omp simd")                                                                    \
        for (int64_t i = from; i < to; i++) {                                                  \
            BODY                                                                               \
        }                                                                                      \
    BACKWARDS_END

/* Where the weights are: pw is float32 (W_F32), or the bfloat16 upper halves of split masters
 * whose lower halves are lo (W_SPLIT). */
#define W_F32 (((const float *)pw)[i])
#define W_F32_STORE (((float *)pw)[i] = w_new)
#define W_SPLIT split_join(((const uint16_t *)pw)[i], lo[i])
#define W_SPLIT_STORE (((uint16_t *)pw)[i] = split_high(w_new), lo[i] = split_low(w_new))

/* A phase-1 loop in its four variants: the weight float32 or a split master (lo != NULL), and
 * the gradient G as it is, or clamped to [glo, ghi] (clip != 0). */
#define PHASE1_VARIANTS(LOOP, G)                                                               \
    if (clip && lo) {                                                                          \
        LOOP(W_SPLIT, clampf(G, glo, ghi))                                                     \
    } else if (clip) {                                                                         \
        LOOP(W_F32, clampf(G, glo, ghi))                                                       \
    } else if (lo) {                                                                           \
        LOOP(W_SPLIT, G)                                                                       \
    } else {                                                                                   \
        LOOP(W_F32, G)                                                                         \
    }

/* ---------------------------------------------------------------------------------------- */
/* LAMB                                                                                       */
/* ---------------------------------------------------------------------------------------- */

/* Phase 1: m, v updated in place; p is only read; the gradient is g * gmul (its scalars: sign,
 * rescaling, clipping factors), clamped to [glo, ghi] when clip != 0. With MODE_DECOUPLED the
 * weight is taken as p * decay_factor (phase 2 writes it so). out[0] = sum w^2,
 * out[1] = sum u^2, u the full update (decay included). */
#define LAMB_PHASE1_LOOP(WLOAD, GLOAD)                                                         \
    BLOCKS_BEGIN("omp parallel for reduction(+ : sw, su) num_threads(nthreads) schedule(static) if (n >= 32768)") \
        float bw = 0.0f, bu = 0.0f;                                                            \
        _Pragma("omp simd reduction(+ : bw, bu)")                                              \
        for (int64_t i = blk; i < end; i++) {                                                  \
            float w = (WLOAD) * f;                                                             \
            float gi = (GLOAD) + wd_g * w;                                                     \
            float mi = m[i] + one_m_b1 * (gi - m[i]);                                          \
            float vi = v[i] * beta2 + one_m_b2 * gi * gi;                                      \
            m[i] = mi;                                                                         \
            v[i] = vi;                                                                         \
            float u = (mi * inv_bc1) / (sqrtf(vi) * inv_bc2_sqrt + eps) + wd_u * w;            \
            bw += w * w;                                                                       \
            bu += u * u;                                                                       \
        }                                                                                      \
        sw += bw;                                                                              \
        su += bu;                                                                              \
    BLOCKS_END

#define LAMB_PHASE1(NAME, GTYPE, GLOAD)                                                        \
    TARGETS static void NAME(const void *pw, const uint16_t *lo, const GTYPE *g, float gmul,   \
                             int clip, float glo, float ghi, float *m, float *v, int64_t n, \
                             float beta1, float beta2, float bc1, float bc2_sqrt, float eps,   \
                             float wd, int mode, float decay_factor, double *out,              \
                             int nthreads) {                                                   \
        double sw = 0.0, su = 0.0;                                                             \
        const float one_m_b1 = 1.0f - beta1, one_m_b2 = 1.0f - beta2;                          \
        const float inv_bc1 = 1.0f / bc1, inv_bc2_sqrt = 1.0f / bc2_sqrt;                      \
        const float f = mode == MODE_DECOUPLED ? decay_factor : 1.0f;                          \
        const float wd_g = mode == MODE_L2 ? wd : 0.0f;                                        \
        const float wd_u = mode == MODE_UPDATE ? wd : 0.0f;                                    \
        PHASE1_VARIANTS(LAMB_PHASE1_LOOP, (GLOAD) * gmul)                                      \
        out[0] = sw;                                                                           \
        out[1] = su;                                                                           \
    }

LAMB_PHASE1(lamb_phase1, float, g[i])
LAMB_PHASE1(lamb_phase1_bf16g, uint16_t, bf16_to_f32(g[i]))

/* Phase 2: p = w - lr * (ratio * u), with w = p * decay_factor in MODE_DECOUPLED. With split
 * != 0, pw and low are a split master's halves; otherwise pw is float32 and the rounded value
 * also goes to low[] (bfloat16) when low is not NULL. */
#define LAMB_PHASE2_LOOP(WLOAD, STOREW)                                                        \
    BACKWARDS_FOR(                                                                             \
        float w = (WLOAD) * f;                                                                 \
        float u = (m[i] * inv_bc1) / (sqrtf(v[i]) * inv_bc2_sqrt + eps) + wd_u * w;            \
        float w_new = w - lr * (ratio * u);                                                    \
        STOREW;                                                                                \
    )

TARGETS static void lamb_phase2(void *pw, const float *m, const float *v, int64_t n, float bc1,
                         float bc2_sqrt, float eps, float wd, int mode, float decay_factor,
                         float lr, float ratio, uint16_t *low, int split, int nthreads) {
    uint16_t *const lo = low;
    const float f = mode == MODE_DECOUPLED ? decay_factor : 1.0f;
    const float wd_u = mode == MODE_UPDATE ? wd : 0.0f;
    const float inv_bc1 = 1.0f / bc1, inv_bc2_sqrt = 1.0f / bc2_sqrt;
    if (split) {
        LAMB_PHASE2_LOOP(W_SPLIT, W_SPLIT_STORE)
    } else if (low) {
        LAMB_PHASE2_LOOP(W_F32, (W_F32_STORE, low[i] = f32_to_bf16(w_new)))
    } else {
        LAMB_PHASE2_LOOP(W_F32, W_F32_STORE)
    }
}

/* ---------------------------------------------------------------------------------------- */
/* LANS                                                                                       */
/* ---------------------------------------------------------------------------------------- */

/* The gradient's sum of squares, LANS's first pass: backwards, so that phase 1 (forwards) starts
 * on the gradient this pass read last. */
#define SUM_SQUARES(NAME, T, LOAD)                                                             \
    TARGETS double NAME(const T *x, int64_t n, int nthreads) {                                 \
        double s = 0.0;                                                                        \
        BACKWARDS_BEGIN("omp parallel reduction(+ : s) num_threads(nthreads) if (n >= 32768)") \
            for (int64_t blk = from; blk < to; blk += RBLOCK) {                                \
                const int64_t end = to - blk < RBLOCK ? to : blk + RBLOCK;                     \
                float b = 0.0f;                                                                \
                _Pragma("omp simd reduction(+ : b)")                                           \
                for (int64_t i = blk; i < end; i++) {                                          \
                    float xi = (LOAD);                                                         \
                    b += xi * xi;                                                              \
                }                                                                              \
                s += b;                                                                        \
            }                                                                                  \
        BACKWARDS_END                                                                          \
        return s;                                                                              \
    }

SUM_SQUARES(sum_squares, float, x[i])
SUM_SQUARES(sum_squares_bf16, uint16_t, bf16_to_f32(x[i]))

/* Phase 1. gt = g * ginv, clamped to [glo, ghi] when clip != 0; moments;
 * d = sqrt(v)/bc2_sqrt + eps; r = (m/bc1)/d + wd*w, c = gt/d + wd*w.
 * out = {sum w^2, sum r^2, sum c^2, sum r*c}. */
#define LANS_PHASE1_LOOP(WLOAD, GT)                                                            \
    BLOCKS_BEGIN("omp parallel for reduction(+ : sw, sr, sc, src) num_threads(nthreads) schedule(static) if (n >= 32768)") \
        float bw = 0.0f, br = 0.0f, bc = 0.0f, brc = 0.0f;                                     \
        _Pragma("omp simd reduction(+ : bw, br, bc, brc)")                                     \
        for (int64_t i = blk; i < end; i++) {                                                  \
            float w = (WLOAD);                                                                 \
            float gt = (GT);                                                                   \
            float mi = m[i] + one_m_b1 * (gt - m[i]);                                          \
            float vi = v[i] * beta2 + one_m_b2 * gt * gt;                                      \
            m[i] = mi;                                                                         \
            v[i] = vi;                                                                         \
            float dinv = 1.0f / (sqrtf(vi) * inv_bc2_sqrt + eps);                              \
            float r = (mi * inv_bc1) * dinv + wd * w;                                          \
            float c = gt * dinv + wd * w;                                                      \
            bw += w * w;                                                                       \
            br += r * r;                                                                       \
            bc += c * c;                                                                       \
            brc += r * c;                                                                      \
        }                                                                                      \
        sw += bw;                                                                              \
        sr += br;                                                                              \
        sc += bc;                                                                              \
        src += brc;                                                                            \
    BLOCKS_END

#define LANS_PHASE1(NAME, GTYPE, GLOAD)                                                        \
    TARGETS static void NAME(const void *pw, const uint16_t *lo, const GTYPE *g, float *m,     \
                             float *v, int64_t n, float ginv, float glo, float ghi, int clip,  \
                             float beta1, float beta2, float bc1, float bc2_sqrt, float eps,   \
                             float wd, double *out, int nthreads) {                            \
        double sw = 0.0, sr = 0.0, sc = 0.0, src = 0.0;                                        \
        const float one_m_b1 = 1.0f - beta1, one_m_b2 = 1.0f - beta2;                          \
        const float inv_bc1 = 1.0f / bc1, inv_bc2_sqrt = 1.0f / bc2_sqrt;                      \
        PHASE1_VARIANTS(LANS_PHASE1_LOOP, (GLOAD) * ginv)                                      \
        out[0] = sw;                                                                           \
        out[1] = sr;                                                                           \
        out[2] = sc;                                                                           \
        out[3] = src;                                                                          \
    }

LANS_PHASE1(lans_phase1, float, g[i])
LANS_PHASE1(lans_phase1_bf16g, uint16_t, bf16_to_f32(g[i]))

/* Phase 2: w1 = w - a * (ratio_r * r); w2 = w1 - b * (ratio_c * c), where c decays w1 when
 * moved != 0 (MXNet's step()) and w otherwise. a = lr*beta1, b = lr*(1-beta1). pw and low as
 * in lamb_phase2. */
#define LANS_PHASE2_LOOP(WLOAD, GT, DECAYED, STOREW)                                           \
    BACKWARDS_FOR(                                                                             \
        float w = (WLOAD);                                                                     \
        float gt = (GT);                                                                       \
        float dinv = 1.0f / (sqrtf(v[i]) * inv_bc2_sqrt + eps);                                \
        float r = (m[i] * inv_bc1) * dinv + wd * w;                                            \
        float w1 = w - a * (ratio_r * r);                                                      \
        float c = gt * dinv + wd * (DECAYED);                                                  \
        float w_new = w1 - b * (ratio_c * c);                                                  \
        STOREW;                                                                                \
    )

#define LANS_PHASE2_LOW(GT, DECAYED)                                                           \
    if (split) {                                                                               \
        LANS_PHASE2_LOOP(W_SPLIT, GT, DECAYED, W_SPLIT_STORE)                                  \
    } else if (low) {                                                                          \
        LANS_PHASE2_LOOP(W_F32, GT, DECAYED, (W_F32_STORE, low[i] = f32_to_bf16(w_new)))       \
    } else {                                                                                   \
        LANS_PHASE2_LOOP(W_F32, GT, DECAYED, W_F32_STORE)                                      \
    }

#define LANS_PHASE2(NAME, GTYPE, GLOAD)                                                        \
    TARGETS static void NAME(void *pw, const GTYPE *g, const float *m, const float *v,         \
                             int64_t n, float ginv, float glo, float ghi, int clip, float bc1, \
                             float bc2_sqrt, float eps, float wd, float a, float b,            \
                             float ratio_r, float ratio_c, int moved, uint16_t *low,           \
                             int split, int nthreads) {                                        \
        uint16_t *const lo = low;                                                              \
        const float inv_bc1 = 1.0f / bc1, inv_bc2_sqrt = 1.0f / bc2_sqrt;                      \
        if (clip && moved) {                                                                   \
            LANS_PHASE2_LOW(clampf((GLOAD) * ginv, glo, ghi), w1)                              \
        } else if (clip) {                                                                     \
            LANS_PHASE2_LOW(clampf((GLOAD) * ginv, glo, ghi), w)                               \
        } else if (moved) {                                                                    \
            LANS_PHASE2_LOW((GLOAD) * ginv, w1)                                                \
        } else {                                                                               \
            LANS_PHASE2_LOW((GLOAD) * ginv, w)                                                 \
        }                                                                                      \
    }

LANS_PHASE2(lans_phase2, float, g[i])
LANS_PHASE2(lans_phase2_bf16g, uint16_t, bf16_to_f32(g[i]))

/* The Adam kernel keeps torch's operations exactly, so no fused multiply-adds here. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* ---------------------------------------------------------------------------------------- */
/* Adam / AdamW (OffloadAdam's host step)                                                    */
/* ---------------------------------------------------------------------------------------- */

/* One pass: g' = g * gmul + wd_l2 * w (gmul folds the loss-scale unscaling, clipping and the
 * sign for maximize into one scalar); m = lerp(m, g', 1-b1); v = b2*v + (1-b2)*g'^2;
 * w = w * decay - step_size * n / (sqrt(v) / bc2_sqrt + eps), where n = m, or
 * b1*m + (1-b1)*g' with nesterov, and decay = 1 - lr*wd for decoupled decay (AdamW), else 1.
 * Same operations in the same order as torch's single-tensor Adam, with the scalars (1-b1, 1-b2,
 * lr/bc1, ...) computed in double by the caller, as torch does.
 *
 * Where the weight lives:
 *  - float32 (adam_f32*): p[i]; the rounded weight also goes to low[] (bfloat16) if not NULL.
 *  - split (adam_split*): a bfloat16 parameter and the low 16 bits of its float32 master.
 *    The master is stored exactly: its upper 16 bits are the parameter's bits, less one when
 *    the parameter was rounded up, i.e. when the low half is >= 0x8000. The parameter is the
 *    master rounded to nearest (ties away from zero). Per parameter that reads and writes 2+2
 *    bytes instead of 4 (master) + 2 (parameter, plus the read that a store to a line not in
 *    cache costs), with a handful of integer operations. */
#define ADAM_LOOP(LOADW, GLOAD, NUM, DENOM, STOREW)                                            \
    OMP_FOR                                                                                    \
    for (int64_t i = 0; i < n; i++) {                                                          \
        float w = (LOADW);                                                                     \
        float gi = (GLOAD) * gmul + wd_l2 * w;                                                 \
        float mi = m[i] + one_m_b1 * (gi - m[i]);                                              \
        float vi = v[i] * beta2 + one_m_b2 * gi * gi;                                          \
        m[i] = mi;                                                                             \
        v[i] = vi;                                                                             \
        float w_new = w * decay - step_size * ((NUM) / (DENOM));                               \
        STOREW;                                                                                \
    }

#define ADAM_NESTEROV(LOADW, GLOAD, DENOM, STOREW)                                             \
    if (nesterov) {                                                                            \
        ADAM_LOOP(LOADW, GLOAD, beta1 * mi + one_m_b1 * gi, DENOM, STOREW)                     \
    } else {                                                                                   \
        ADAM_LOOP(LOADW, GLOAD, mi, DENOM, STOREW)                                             \
    }

/* float32 weights: torch's exact sqrt(v)/bc2_sqrt + eps. Split (bfloat16) weights, whose
 * parameter is rounded anyway: sqrt(v) * (1/bc2_sqrt) + eps, one division less per element
 * (within an ulp of the division). */
#define DENOM_EXACT sqrtf(vi) / bc2_sqrt + eps
#define DENOM_FAST sqrtf(vi) * inv_bc2_sqrt + eps

#define ADAM_ARGS                                                                              \
    float *m, float *v, int64_t n, float step_size, float beta1, float one_m_b1, float beta2,  \
        float one_m_b2, float bc2_sqrt, float eps, float wd_l2, float decay, float gmul,       \
        int nesterov, int nthreads

#define ADAM_F32(NAME, GTYPE, GLOAD)                                                           \
    TARGETS static void NAME(float *p, uint16_t *low, const GTYPE *g, ADAM_ARGS) {             \
        if (low) {                                                                             \
            ADAM_NESTEROV(p[i], GLOAD, DENOM_EXACT, (p[i] = w_new, low[i] = f32_to_bf16(w_new))) \
        } else {                                                                               \
            ADAM_NESTEROV(p[i], GLOAD, DENOM_EXACT, p[i] = w_new)                              \
        }                                                                                      \
    }

#define ADAM_SPLIT(NAME, GTYPE, GLOAD)                                                         \
    TARGETS static void NAME(uint16_t *hi, uint16_t *lo, const GTYPE *g, ADAM_ARGS) {          \
        const float inv_bc2_sqrt = 1.0f / bc2_sqrt;                                            \
        ADAM_NESTEROV(split_join(hi[i], lo[i]), GLOAD, DENOM_FAST,                             \
                      (hi[i] = split_high(w_new), lo[i] = split_low(w_new)))                   \
    }

ADAM_F32(adam_f32, float, g[i])
ADAM_F32(adam_f32_bf16g, uint16_t, bf16_to_f32(g[i]))
ADAM_SPLIT(adam_split, float, g[i])
ADAM_SPLIT(adam_split_bf16g, uint16_t, bf16_to_f32(g[i]))

/* One Adam step on each of `count` tensors (see TensorArgs); step[t] is incremented. */
void adam_multi(const AdamTensor *ts, int64_t count, const AdamConfig *cfg) {
    for (int64_t t = 0; t < count; t++) {
        const AdamTensor *x = &ts[t];
        *x->step += 1.0f; /* the state's step counter (a float32 scalar tensor) */
#define ADAM_CALL(FN, WT, GT)                                                                  \
    FN((WT *)x->w, x->low, (const GT *)x->g, x->m, x->v, x->n, x->step_size, cfg->beta1,       \
       cfg->one_m_b1, cfg->beta2, cfg->one_m_b2, x->bc2_sqrt, cfg->eps, x->wd_l2, x->decay,    \
       x->gmul, cfg->nesterov, cfg->nthreads)
        switch (x->kind) {
        case 0: ADAM_CALL(adam_f32, float, float); break;
        case 1: ADAM_CALL(adam_f32_bf16g, float, uint16_t); break;
        case 2: ADAM_CALL(adam_split, uint16_t, float); break;
        default: ADAM_CALL(adam_split_bf16g, uint16_t, uint16_t); break;
        }
#undef ADAM_CALL
    }
}

#pragma GCC pop_options

/* ---------------------------------------------------------------------------------------- */
/* LAMB and LANS over all tensors of a group in one call                                     */
/* ---------------------------------------------------------------------------------------- */

/* The trust ratio ||w|| / ||u|| from squared norms, ||w|| clamped to [lower, upper] where
 * given; 1 when either norm is 0 or the ratio is not finite. */
static double trust_ratio(double w2, double u2, const LayerwiseConfig *cfg) {
    double w = sqrt(w2), u = sqrt(u2);
    if (cfg->has_lower && w < cfg->lower) w = cfg->lower;
    if (cfg->has_upper && w > cfg->upper) w = cfg->upper;
    if (w > 0.0 && u > 0.0 && isfinite(w / u)) return w / u;
    return 1.0;
}

/* Per tensor: its step counter (a float32 scalar) is incremented and the bias corrections
 * computed from it in double, as the Python side does (1 - beta^t, (1 - beta2^t) ** 0.5). */
static void bias_corrections(float *step, int advance, const LayerwiseConfig *cfg, double *bc1,
                             double *bc2_sqrt) {
    if (advance) *step += 1.0f;
    double t = (double)*step;
    *bc1 = cfg->bias_correction ? 1.0 - pow(cfg->beta1, t) : 1.0;
    *bc2_sqrt = cfg->bias_correction ? pow(1.0 - pow(cfg->beta2, t), 0.5) : 1.0;
}

/* Each multi-tensor update runs per tensor as sums (phase 1: the step counter advanced, the
 * moments updated, the sums the trust ratios need) and apply (phase 2: the weights). The *_multi
 * functions run both on one tensor after the other (the second pass finds the first one's data
 * in the caches); *_multi_sums and *_multi_apply run each over all tensors, so that the sums of
 * sharded tensors' local pieces can be totalled (one all-reduce) in between. */

static void lamb_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double *sums) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 1, cfg, &bc1, &bc2_sqrt);
    const float decay = (float)(1.0 - x->lr * x->wd);
    uint16_t *lo = (x->kind & 2) ? x->low : NULL;
#define CALL_LAMB_PHASE1(FN, GT)                                                               \
    FN(x->w, lo, (const GT *)x->g, x->gmul, cfg->clip, cfg->clip_lo, cfg->clip_hi, x->m, x->v, \
       x->n, (float)cfg->beta1, (float)cfg->beta2, (float)bc1, (float)bc2_sqrt, cfg->eps,      \
       (float)x->wd, cfg->mode, decay, sums, cfg->nthreads)
    if (x->kind & 1)
        CALL_LAMB_PHASE1(lamb_phase1_bf16g, uint16_t);
    else
        CALL_LAMB_PHASE1(lamb_phase1, float);
#undef CALL_LAMB_PHASE1
}

static void lamb_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg, const double *sums) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 0, cfg, &bc1, &bc2_sqrt);
    const float decay = (float)(1.0 - x->lr * x->wd);
    const double ratio = x->adapt ? trust_ratio(sums[0], sums[1], cfg) : 1.0;
    lamb_phase2(x->w, x->m, x->v, x->n, (float)bc1, (float)bc2_sqrt, cfg->eps, (float)x->wd,
                cfg->mode, decay, (float)x->lr, (float)ratio, x->low, (x->kind & 2) != 0,
                cfg->nthreads);
}

void lamb_multi(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg) {
    double sums[2];
    for (int64_t t = 0; t < count; t++) {
        lamb_sums(&ts[t], cfg, sums);
        lamb_apply(&ts[t], cfg, sums);
    }
}

/* sums[2t], sums[2t + 1]: ||w||^2 and ||u||^2 of tensor t (of its local piece). */
void lamb_multi_sums(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                     double *sums) {
    for (int64_t t = 0; t < count; t++) lamb_sums(&ts[t], cfg, sums + 2 * t);
}

/* The tensors in the order opposite to the sums pass, which left the last ones in the caches. */
void lamb_multi_apply(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                      const double *sums) {
    for (int64_t t = count - 1; t >= 0; t--) lamb_apply(&ts[t], cfg, sums + 2 * t);
}

/* LANS's gradient norm: x->gsq when given (>= 0: already computed by the same sum_squares, for
 * the clipping norms, so that pass is not run again), else one pass over the gradient. */
static double grad_sum_squares(const LayerwiseTensor *x, int nthreads) {
    if (x->gsq >= 0.0) return x->gsq;
    return (x->kind & 1) ? sum_squares_bf16((const uint16_t *)x->g, x->n, nthreads)
                         : sum_squares((const float *)x->g, x->n, nthreads);
}

/* The normalised gradient of g * gm is sign(gm) * g / ||g||: gm goes into this factor (0 for a
   zero gradient; NaN for a non-finite one, which then propagates). */
static float lans_ginv(const LayerwiseTensor *x, const LayerwiseConfig *cfg) {
    const double gm = (double)x->gmul;
    const double gnorm = fabs(gm) * sqrt(grad_sum_squares(x, cfg->nthreads));
    return (float)(gnorm == 0.0 ? 0.0 : gm / gnorm);
}

static void lans_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg, float ginv,
                      double *sums) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 1, cfg, &bc1, &bc2_sqrt);
    uint16_t *lo = (x->kind & 2) ? x->low : NULL;
#define CALL_LANS_PHASE1(FN, GT)                                                               \
    FN(x->w, lo, (const GT *)x->g, x->m, x->v, x->n, ginv, cfg->clip_lo, cfg->clip_hi,         \
       cfg->clip, (float)cfg->beta1, (float)cfg->beta2, (float)bc1, (float)bc2_sqrt, cfg->eps, \
       (float)x->wd, sums, cfg->nthreads)
    if (x->kind & 1)
        CALL_LANS_PHASE1(lans_phase1_bf16g, uint16_t);
    else
        CALL_LANS_PHASE1(lans_phase1, float);
#undef CALL_LANS_PHASE1
}

static void lans_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg, float ginv,
                       const double *sums) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 0, cfg, &bc1, &bc2_sqrt);
    const double a = x->lr * cfg->beta1, b = x->lr * (1.0 - cfg->beta1);
    double c2 = sums[2];
    const double ratio_r = x->adapt ? trust_ratio(sums[0], sums[1], cfg) : 1.0;
    if (cfg->moved) { /* c' = c - wd*a*ratio_r*r: ||c'||^2 from the sums of phase 1 */
        const double k = x->wd * a * ratio_r;
        c2 = c2 - 2.0 * k * sums[3] + k * k * sums[1];
        if (c2 < 0.0) c2 = 0.0;
    }
    const double ratio_c = x->adapt ? trust_ratio(sums[0], c2, cfg) : 1.0;
#define CALL_LANS_PHASE2(FN, GT)                                                               \
    FN(x->w, (const GT *)x->g, x->m, x->v, x->n, ginv, cfg->clip_lo, cfg->clip_hi, cfg->clip,  \
       (float)bc1, (float)bc2_sqrt, cfg->eps, (float)x->wd, (float)a, (float)b, (float)ratio_r, \
       (float)ratio_c, cfg->moved, x->low, (x->kind & 2) != 0, cfg->nthreads)
    if (x->kind & 1)
        CALL_LANS_PHASE2(lans_phase2_bf16g, uint16_t);
    else
        CALL_LANS_PHASE2(lans_phase2, float);
#undef CALL_LANS_PHASE2
}

void lans_multi(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg) {
    double sums[4];
    for (int64_t t = 0; t < count; t++) {
        const float ginv = lans_ginv(&ts[t], cfg);
        lans_sums(&ts[t], cfg, ginv, sums);
        lans_apply(&ts[t], cfg, ginv, sums);
    }
}

/* sums[4t .. 4t + 3]: ||w||^2, ||r||^2, ||c||^2 and <c, r> of tensor t (of its local piece);
 * ts[t].gsq must hold the whole gradient's sum of squares. Each pass over all tensors goes in
 * the order opposite to the one before (gradients' sums ascending, these descending, apply
 * ascending), so that it starts on the data the previous one left in the caches. */
void lans_multi_sums(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                     double *sums) {
    /* the gradients' sums were taken in ascending order: start where they ended */
    for (int64_t t = count - 1; t >= 0; t--)
        lans_sums(&ts[t], cfg, lans_ginv(&ts[t], cfg), sums + 4 * t);
}

void lans_multi_apply(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                      const double *sums) {
    for (int64_t t = 0; t < count; t++)
        lans_apply(&ts[t], cfg, lans_ginv(&ts[t], cfg), sums + 4 * t);
}

/* 1 when any of x[0..n) is inf or NaN. */
TARGETS int any_nonfinite(const float *x, int64_t n, int nthreads) {
    int bad = 0;
#pragma omp parallel for simd reduction(| : bad) num_threads(nthreads) schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; i++) bad |= !((x[i] - x[i]) == 0.0f);
    return bad;
}

TARGETS int any_nonfinite_bf16(const uint16_t *x, int64_t n, int nthreads) {
    int bad = 0;
#pragma omp parallel for simd reduction(| : bad) num_threads(nthreads) schedule(static) if (n >= 32768)
    for (int64_t i = 0; i < n; i++) bad |= (x[i] & 0x7f80u) == 0x7f80u;
    return bad;
}

/* ---------------------------------------------------------------------------------------- */
/* DGC selection                                                                              */
/* ---------------------------------------------------------------------------------------- */

/* Indices i with |v[i]| >= thr, in order, into out[0..cap); returns how many there are (which
 * may exceed cap: then only the first cap were written). One read pass, no allocation. */
/* Blocks of SELECT_BLOCK elements are first tested as a whole (a vectorised compare and OR);
   only the rare block holding a candidate is scanned element by element, in order. */
#define SELECT_BLOCK 64

TARGETS int64_t select_above(const float *v, int64_t n, float thr, int64_t *out, int64_t cap) {
    int64_t count = 0, i = 0;
    for (; i < n; i += SELECT_BLOCK) {
        const int64_t end = i + SELECT_BLOCK < n ? i + SELECT_BLOCK : n;
        int hit = 0;
        for (int64_t j = i; j < end; j++) hit |= fabsf(v[j]) >= thr;
        if (!hit) continue;
        for (int64_t j = i; j < end; j++) {
            if (fabsf(v[j]) >= thr) {
                if (count < cap) out[count] = j;
                count++;
            }
        }
    }
    return count;
}

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "Fused CPU kernels (called through ctypes).", -1,
                                            NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }

/* ---- compact optimizer state (scaleopt._compact) ------------------------------------------
 * int8 moments: rows of row_len elements, blocks of 256 within a row (the last one shorter),
 * one float32 scale per block (its largest magnitude). Signed codes q = rint(127 sqrt(|x|/s))
 * sign(x), decoded as s (q/127)^2 sign(q); unsigned codes q = rint(255 (x/s)^(1/4)), decoded
 * as s (q/255)^4. The same float operations, in the same order, as the PyTorch reference, so
 * both give the same codes. bfloat16 moments: rounded stochastically with 16 random bits, a
 * 32-bit hash of the element's global index (offset + i) and a key of the step and moment. */

#define COMPACT_BLOCK 256

/* Block b of rows of row_len elements (blocks per row): where it starts in the flat tensor,
 * and how many elements it holds. */
static inline int64_t block_start(int64_t b, int64_t blocks, int64_t row_len, int64_t *len) {
    const int64_t start = (b % blocks) * COMPACT_BLOCK;
    *len = row_len - start < COMPACT_BLOCK ? row_len - start : COMPACT_BLOCK;
    return (b / blocks) * row_len + start;
}

/* Opens the loop over the blocks of rows x row_len, in parallel: block b, its first element
 * at, its length len. */
#define EACH_BLOCK(rows, row_len)                                                              \
    const int64_t blocks = ((row_len) + COMPACT_BLOCK - 1) / COMPACT_BLOCK;                   \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (rows * row_len >= 65536)") \
    for (int64_t b = 0; b < (rows) * blocks; b++)                                              \
        for (int64_t len = 0, at = block_start(b, blocks, row_len, &len), once = 1; once; once = 0)

TARGETS void int8_encode(const float *x, void *codes, float *scales, int64_t rows,
                         int64_t row_len, int32_t is_signed, int32_t nthreads) {
    EACH_BLOCK(rows, row_len) {
        const float *in = x + at;
        float s = 0.0f;
        for (int64_t i = 0; i < len; i++) s = fmaxf(s, fabsf(in[i]));
        scales[b] = s;
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        if (is_signed) {
            int8_t *out = (int8_t *)codes + at;
            for (int64_t i = 0; i < len; i++) {
                const float q = rintf(sqrtf(fabsf(in[i]) * inv) * 127.0f);
                out[i] = (int8_t)(in[i] < 0.0f ? -q : q);
            }
        } else {
            uint8_t *out = (uint8_t *)codes + at;
            for (int64_t i = 0; i < len; i++)
                out[i] = (uint8_t)rintf(sqrtf(sqrtf(fabsf(in[i]) * inv)) * 255.0f);
        }
    }
}

TARGETS void int8_decode(const void *codes, const float *scales, float *x, int64_t rows,
                         int64_t row_len, int32_t is_signed, int32_t nthreads) {
    EACH_BLOCK(rows, row_len) {
        const float s = scales[b];
        float *out = x + at;
        if (is_signed) {
            const int8_t *in = (const int8_t *)codes + at;
            for (int64_t i = 0; i < len; i++) {
                const float t = (float)in[i] / 127.0f;
                out[i] = (t * fabsf(t)) * s;
            }
        } else {
            const uint8_t *in = (const uint8_t *)codes + at;
            for (int64_t i = 0; i < len; i++) {
                const float t = (float)in[i] / 255.0f;
                const float t2 = t * t;
                out[i] = (t2 * t2) * s;
            }
        }
    }
}

TARGETS void bf16_round_stochastic(const float *x, uint16_t *out, int64_t n, int64_t offset,
                                   int64_t key, int32_t nthreads) {
#pragma omp parallel for simd num_threads(nthreads) schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = (uint32_t)(offset + i) + (uint32_t)key;
        h = ((h >> 16) ^ h) * 0x45D9F3Bu;
        h = ((h >> 16) ^ h) * 0x45D9F3Bu;
        h = (h >> 16) ^ h;
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        out[i] = (uint16_t)((bits + (h & 0xFFFFu)) >> 16);
    }
}
