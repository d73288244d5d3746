/*
 * Fused CPU kernels for LAMB, LANS and Adam on contiguous tensors: float32 weights (or
 * bfloat16 parameters with float32 or split masters), float32 or bfloat16 gradients, moments
 * in float32, bfloat16 or 8-bit codes.
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
 * Moments stored in bfloat16 or 8 bits (scaleopt._compact) are read and written in place by the
 * same passes, block by block (see "LAMB and LANS on compact moments"): no float32 copy of a
 * moment is made, and LAMB with int8 moments moves about 26 bytes per parameter. On CPUs with
 * AVX-512 those loops run 16 lanes at a time (see "Compact moments with AVX-512").
 *
 * The module is also a (empty) Python extension so that setuptools builds it like one; it uses
 * only the stable ABI of Python 3.10, so one build serves every CPython from 3.10 on.
 */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_format.h" /* the compact format's constants (scaleopt/_format.py) */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
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
    void *m;          /* first moment: float32, or as COMPACT_FIELDS say */                   \
    void *v;          /* second moment: likewise */                                           \
    uint16_t *low;    /* see kind; NULL for none */                                          \
    float *step;      /* the step counter (a float32 scalar), incremented */                 \
    int64_t n;        /* elements */                                                         \
    int32_t kind;                                                                              \
    float gmul;       /* the scalar the gradient is taken times */

/* The moments' storage (scaleopt._compact): form FORM_F32 (m and v are float32), FORM_BF16
 * (bfloat16) or FORM_INT8 (m int8 codes, v uint8 codes, with float32 scales, one per block of
 * 256 within a row). The compact forms are read and written block by block inside the update's
 * passes, with no float32 copy of the moments. */
#define COMPACT_FIELDS                                                                         \
    float *m_scale, *v_scale; /* FORM_INT8: the scales, rows x blocks */                      \
    int64_t row_len;          /* FORM_INT8: elements per row; FORM_BF16: n */                 \
    int64_t offset;           /* FORM_BF16: element 0's index in the whole tensor */          \
    int32_t form;

typedef struct {
    TENSOR_FIELDS
    double lr, wd; /* learning rate, weight decay */
    double gsq;    /* LANS: the gradient's sum of squares when already computed, else < 0 */
    int32_t adapt; /* whether the trust ratio applies */
    COMPACT_FIELDS
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
    COMPACT_FIELDS
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
#define COMPACT_OFFSETS(S)                                                                     \
    FIELD(S, m_scale), FIELD(S, v_scale), FIELD(S, row_len), FIELD(S, offset), FIELD(S, form)
    const int64_t layouts[4][26] = {
        {sizeof(LayerwiseTensor), TENSOR_OFFSETS(LayerwiseTensor), FIELD(LayerwiseTensor, lr),
         FIELD(LayerwiseTensor, wd), FIELD(LayerwiseTensor, gsq), FIELD(LayerwiseTensor, adapt),
         COMPACT_OFFSETS(LayerwiseTensor), -1},
        {sizeof(LayerwiseConfig), FIELD(LayerwiseConfig, beta1), FIELD(LayerwiseConfig, beta2),
         FIELD(LayerwiseConfig, lower), FIELD(LayerwiseConfig, upper),
         FIELD(LayerwiseConfig, eps), FIELD(LayerwiseConfig, clip_lo),
         FIELD(LayerwiseConfig, clip_hi), FIELD(LayerwiseConfig, bias_correction),
         FIELD(LayerwiseConfig, has_lower), FIELD(LayerwiseConfig, has_upper),
         FIELD(LayerwiseConfig, clip), FIELD(LayerwiseConfig, nthreads),
         FIELD(LayerwiseConfig, mode), FIELD(LayerwiseConfig, moved), -1},
        {sizeof(AdamTensor), TENSOR_OFFSETS(AdamTensor), FIELD(AdamTensor, step_size),
         FIELD(AdamTensor, bc2_sqrt), FIELD(AdamTensor, wd_l2), FIELD(AdamTensor, decay),
         COMPACT_OFFSETS(AdamTensor), -1},
        {sizeof(AdamConfig), FIELD(AdamConfig, beta1), FIELD(AdamConfig, one_m_b1),
         FIELD(AdamConfig, beta2), FIELD(AdamConfig, one_m_b2), FIELD(AdamConfig, eps),
         FIELD(AdamConfig, nesterov), FIELD(AdamConfig, nthreads), -1},
    };
#undef TENSOR_OFFSETS
#undef COMPACT_OFFSETS
    if (which < 0 || which > 3) return 0;
    int64_t k = 0;
    while (k < 26 && layouts[which][k] >= 0) {
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

/* ---------------------------------------------------------------------------------------- */
/* Compact moments (scaleopt._compact), block by block                                       */
/* ---------------------------------------------------------------------------------------- */

/* Moments stored in bfloat16 (rounded stochastically) or int8 (blocks of COMPACT_BLOCK within a
 * row, a float32 scale each: signed codes on a square-root scale for m, unsigned 8-bit floats
 * rounded stochastically for v): the formats are described once, in docs/state.md, their
 * constants are _format.h's, and scaleopt._compact.quantize is the reference these loops store
 * the same bits as. The sum y + 2^-31 is taken in double here, where it is exact or rounds to
 * 2^-31 either way, so that no compiler fuses it with the product. */

#define COMPACT_BLOCK FORMAT_BLOCK
enum { FORM_F32 = 0, FORM_BF16 = 1, FORM_INT8 = 2 };
#define INLINE static inline __attribute__((always_inline))

/* Block b of rows of row_len elements (blocks per row): where it starts in the flat tensor,
 * and how many elements it holds. */
static inline int64_t block_start(int64_t b, int64_t blocks, int64_t row_len, int64_t *len) {
    const int64_t start = (b % blocks) * COMPACT_BLOCK;
    *len = row_len - start < COMPACT_BLOCK ? row_len - start : COMPACT_BLOCK;
    return (b / blocks) * row_len + start;
}

/* F(q) of an unsigned code (see above): the float32 of bits (q + 768) << 20. */
static inline float code_float(uint32_t q) {
    const uint32_t u = (q + FORMAT_CODE_OFFSET) << FORMAT_CODE_SHIFT;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A 32-bit hash of h (index + key). */
INLINE uint32_t hash32(uint32_t h) {
    h = ((h >> 16) ^ h) * FORMAT_HASH_MUL;
    h = ((h >> 16) ^ h) * FORMAT_HASH_MUL;
    return (h >> 16) ^ h;
}

/* 16 random bits, the lower half of the hash of h (index + key). */
INLINE uint32_t random16(uint32_t h) { return hash32(h) & 0xFFFFu; }

/* The random bits of the unsigned code at position i of a block whose first element's
 * global index plus the key is g: positions i and i + 16 of each 32 take the two halves of
 * one hash, of g + 16 (i div 32) + i mod 16 (an index inside the block: no two blocks and no
 * two pairs share one). */
INLINE uint32_t code_random16(uint32_t g, int64_t i) {
    const uint32_t h = hash32(g + (uint32_t)((i >> 5 << 4) | (i & 15)));
    return i & 16 ? h >> 16 : h & 0xFFFFu;
}

/* x rounded to bfloat16 up or down by the random bits of h (index + key). */
INLINE uint16_t round_stochastic(float x, uint32_t h) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)((bits + random16(h)) >> 16);
}

/* The key of the rounding hash at a step, for a moment (its salt): as _compact._key. */
static inline uint32_t rounding_key(float step, uint32_t salt) {
    return (uint32_t)(int64_t)step * FORMAT_STEP_MUL + salt * FORMAT_SALT_MUL;
}

/* Block b of a stored moment (len elements from element at) decoded into out[0..len). */
INLINE void decode_block(const void *codes, const float *scales, int form, int is_signed,
                         int64_t b, int64_t at, int64_t len, float *out) {
    if (form == FORM_BF16) {
        const uint16_t *in = (const uint16_t *)codes + at;
        for (int64_t i = 0; i < len; i++) out[i] = bf16_to_f32(in[i]);
    } else if (is_signed) {
        const float step = scales[b] / FORMAT_SIGNED_SCALE;
        const int8_t *in = (const int8_t *)codes + at;
        for (int64_t i = 0; i < len; i++) {
            const int32_t q = in[i];
            out[i] = (float)(q * (q < 0 ? -q : q)) * step;
        }
    } else {
        const float step = scales[b] / FORMAT_UNSIGNED_SCALE;
        const uint8_t *in = (const uint8_t *)codes + at;
        for (int64_t i = 0; i < len; i++) out[i] = (code_float(in[i]) - FORMAT_CODE_LOW) * step;
    }
}

/* The largest magnitude of in[0..len) (NaNs passed over). */
INLINE float block_max(const float *in, int64_t len) {
    float s = 0.0f;
#pragma omp simd reduction(max : s)
    for (int64_t i = 0; i < len; i++) {
        const float a = fabsf(in[i]);
        s = a > s ? a : s;
    }
    return s;
}

/* 127^2 / s and 1.875 / s: y = |x| times this (0 for an all-zero block). */
static inline float code_factor(int is_signed, float s) {
    return s > 0.0f ? (is_signed ? FORMAT_SIGNED_SCALE : FORMAT_UNSIGNED_SCALE) / s : 0.0f;
}

/* The signed code's magnitude of y >= 0 (see above), 0 for a NaN: trunc(sqrt(y) + 0.47) is it
 * or one less. */
static inline int32_t code_signed(float y) {
    const float t = sqrtf(y) + FORMAT_ROOT_OFFSET;
    const int32_t q = (int32_t)(y > 0.0f ? t : 0.0f);
    const float b = (float)q + 0.5f;
    return q + ((b * b <= y) & 1);
}

/* The unsigned code of y >= 0 with random bits r (see above); 0 for a NaN. */
static inline int32_t code_unsigned(float y, uint32_t r) {
    float z = (float)((double)y + FORMAT_CODE_LOW_DOUBLE);
    z = z >= FORMAT_CODE_LOW ? z : FORMAT_CODE_LOW;
    uint32_t bits;
    memcpy(&bits, &z, 4);
    const int32_t q = (int32_t)((bits + (r << 4)) >> FORMAT_CODE_SHIFT) - (int32_t)FORMAT_CODE_OFFSET;
    return q < 255 ? q : 255;
}

/* in[0..len) stored as block b of a moment (its elements from at): bfloat16 rounded with the
 * bits of global index offset + at + i, or codes with the scale s, the block's largest
 * magnitude (block_max). */
INLINE void encode_block(void *codes, float *scales, int form, int is_signed, int64_t b,
                         int64_t at, int64_t len, const float *in, float s, int64_t offset,
                         uint32_t key) {
    if (form == FORM_BF16) {
        uint16_t *out = (uint16_t *)codes + at;
        for (int64_t i = 0; i < len; i++)
            out[i] = round_stochastic(in[i], (uint32_t)(offset + at + i) + key);
        return;
    }
    scales[b] = s;
    const float c = code_factor(is_signed, s);
    if (is_signed) {
        int8_t *out = (int8_t *)codes + at;
        for (int64_t i = 0; i < len; i++) {
            const int32_t q = code_signed(fabsf(in[i]) * c);
            out[i] = (int8_t)(in[i] < 0.0f ? -q : q);
        }
        return;
    }
    uint8_t *out = (uint8_t *)codes + at;
    const uint32_t h = (uint32_t)(offset + at) + key;
    for (int64_t i = 0; i < len; i++)
        out[i] = (uint8_t)code_unsigned(fabsf(in[i]) * c, code_random16(h, i));
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

/* Phase 2: w1 = w - lr_r * (ratio_r * r); w2 = w1 - lr_c * (ratio_c * c), where c decays w1
 * when moved != 0 (MXNet's step()) and w otherwise: the rates of r and c, lr_r = lr*beta1 and
 * lr_c = lr*(1-beta1). pw and low as in lamb_phase2. */
#define LANS_PHASE2_LOOP(WLOAD, GT, DECAYED, STOREW)                                           \
    BACKWARDS_FOR(                                                                             \
        float w = (WLOAD);                                                                     \
        float gt = (GT);                                                                       \
        float dinv = 1.0f / (sqrtf(v[i]) * inv_bc2_sqrt + eps);                                \
        float r = (m[i] * inv_bc1) * dinv + wd * w;                                            \
        float w1 = w - lr_r * (ratio_r * r);                                                   \
        float c = gt * dinv + wd * (DECAYED);                                                  \
        float w_new = w1 - lr_c * (ratio_c * c);                                               \
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
                             float bc2_sqrt, float eps, float wd, float lr_r, float lr_c,      \
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

/* ---------------------------------------------------------------------------------------- */
/* LAMB and LANS on compact moments                                                           */
/* ---------------------------------------------------------------------------------------- */

/* Moments stored in bfloat16 or 8 bits are updated block by block (the blocks of their
 * scales, 256 elements within a row), with the float32 kernels' operations. Pass 1 reads w, g
 * and the stored moments and sums the norms of the new moments' update without storing
 * anything; pass 2 computes the same new moments again, writes the weights, and stores the
 * moments once the block's largest values are known. int8 codes, float32 weights and float32
 * gradients are read inside the update's loop; other forms (split masters, bfloat16 gradients,
 * bfloat16 moments) are first converted into float32 arrays of one block on the stack. With
 * int8 moments LAMB moves about 26 bytes per parameter (10 + 16) against 40 with float32
 * ones, and no float32 copy of a moment is ever made. */

/* Where a compact kernel reads a tensor's weights and gradient. */
typedef struct {
    const void *w;      /* float32 weights, or a split master's upper halves (lo != NULL) */
    const uint16_t *lo; /* a split master's lower halves, or NULL */
    const void *g;      /* float32 or (g_bf16) bfloat16 gradient */
    int g_bf16;
    float wmul, gmul, glo, ghi; /* the weights taken times wmul; the gradient times gmul,
                                   clamped to [glo, ghi] (infinite bounds: no clipping) */
} Staging;

/* A tensor's stored moments; the keys of their bfloat16 rounding at this step. */
typedef struct {
    void *m, *v;
    float *m_scale, *v_scale;
    int form;
    int64_t offset;
    uint32_t m_key, v_key;
} Stored;

/* The most floats of the buffer where LAMB and LANS keep updates between their passes
 * (keep_take): 8 MiB, about what a core's share of the last-level cache holds along with the
 * weights and gradients of the blocks it covers. */
#define KEEP_CAP ((int64_t)1 << 21)

/* That buffer, as a step holds it: size floats at at. */
typedef struct {
    float *at;
    int64_t size;
} Keep;

#define STORED_OF(x)                                                                           \
    ((Stored){(x)->m, (x)->v, (x)->m_scale, (x)->v_scale, (x)->form, (x)->offset,               \
              rounding_key(*(x)->step, FORMAT_SALT_EXP_AVG),                                  \
              rounding_key(*(x)->step, FORMAT_SALT_EXP_AVG_SQ)})

INLINE void stage_w(const Staging *s, int64_t at, int64_t len, float *wb) {
    const uint16_t *hi = (const uint16_t *)s->w + at, *lo = s->lo + at;
    for (int64_t i = 0; i < len; i++) wb[i] = split_join(hi[i], lo[i]);
}

INLINE void stage_g(const Staging *s, int64_t at, int64_t len, float *gb) {
    const uint16_t *g = (const uint16_t *)s->g + at;
    for (int64_t i = 0; i < len; i++) gb[i] = bf16_to_f32(g[i]);
}

/* The new weights of a block, from wb: a split master's two halves (split != 0, low the lower
 * ones), or float32 rounded into the bfloat16 low[] as well. */
INLINE void unstage_w(void *w, uint16_t *low, int split, int64_t at, int64_t len,
                      const float *wb) {
    if (split) {
        uint16_t *hi = (uint16_t *)w + at, *lo = low + at;
        for (int64_t i = 0; i < len; i++) hi[i] = split_high(wb[i]), lo[i] = split_low(wb[i]);
        return;
    }
    float *p = (float *)w + at;
    for (int64_t i = 0; i < len; i++) p[i] = wb[i], low[at + i] = f32_to_bf16(wb[i]);
}

/* A tensor's blocks: per_row in each row of row_len elements, total in all; and this
 * thread's contiguous share [first, last) of them, with its arrays for one block. */
#define COMPACT_GRID(x)                                                                        \
    const int64_t n = (x)->n, row_len = (x)->row_len;                                          \
    const int64_t per_row = (row_len + COMPACT_BLOCK - 1) / COMPACT_BLOCK;                     \
    const int64_t total = row_len > 0 ? n / row_len * per_row : 0
#define THREAD_BLOCKS                                                                          \
    const int id_ = omp_get_thread_num(), nt_ = omp_get_num_threads();                         \
    const int64_t first = total * id_ / nt_, last = total * (id_ + 1) / nt_;                   \
    float wb[COMPACT_BLOCK], gb[COMPACT_BLOCK], mb[COMPACT_BLOCK], vb[COMPACT_BLOCK]

/* Block b's inputs as the loop reads them: wp[i] * wf, clamp(gp[i] * gm, glo, ghi), and the
 * moments decoded into mb, vb.
 * wo: where the loop writes the new weights (in place, or wb for unstage_w). */
#define BLOCK_INPUTS(b, x)                                                                     \
    int64_t len;                                                                               \
    const int64_t at = block_start(b, per_row, row_len, &len);                                 \
    const float *wp = (const float *)s.w + at, *gp = (const float *)s.g + at;                  \
    float wf = s.wmul, gm = s.gmul, glo = s.glo, ghi = s.ghi;                                  \
    if (s.lo) stage_w(&s, at, len, wb), wp = wb;                                               \
    if (s.g_bf16) stage_g(&s, at, len, gb), gp = gb;                                           \
    decode_block(st.m, st.m_scale, st.form, 1, b, at, len, mb);                                \
    decode_block(st.v, st.v_scale, st.form, 0, b, at, len, vb);                                \
    const int in_place = !((x)->kind & 2) && !(x)->low;                                        \
    float *wo = in_place ? (float *)(x)->w + at : wb;                                          \
    (void)wo; (void)wf; (void)gm; (void)glo; (void)ghi
/* After pass 2's loop (which put the new moments in mb, vb and their largest magnitudes in
 * am, av): the weights and the moments stored. */
#define BLOCK_OUTPUTS(b, x)                                                                    \
    if (!in_place) unstage_w((x)->w, (x)->low, ((x)->kind & 2) != 0, at, len, wb);             \
    encode_block(st.m, st.m_scale, st.form, 1, b, at, len, mb, am, st.offset, st.m_key);       \
    encode_block(st.v, st.v_scale, st.form, 0, b, at, len, vb, av, st.offset, st.v_key)
/* Pass 2's loop ends: the new moments staged in the block's buffers (encoded after the loop),
 * their largest magnitudes taken. */
#define STAGE_MOMENTS                                                                          \
    mb[i] = mi;                                                                                \
    vb[i] = vi;                                                                                \
    am = fabsf(mi) > am ? fabsf(mi) : am;                                                      \
    av = vi > av ? vi : av;

/* Over this thread's blocks (a parallel region opened by PRAGMA): each block's inputs, then
 * the statements given. */
#define EACH_COMPACT_BLOCK(x, PRAGMA, ...)                                                     \
    _Pragma(PRAGMA) {                                                                          \
        THREAD_BLOCKS;                                                                         \
        for (int64_t b = first; b < last; b++) {                                               \
            BLOCK_INPUTS(b, x);                                                                \
            __VA_ARGS__                                                                        \
        }                                                                                      \
    }
#define PARALLEL "omp parallel num_threads(cfg->nthreads) if (n >= 32768)"

static Staging staging_of(const LayerwiseTensor *x, const LayerwiseConfig *cfg, float wmul,
                          float gmul) {
    return (Staging){x->w, (x->kind & 2) ? x->low : NULL, x->g, x->kind & 1, wmul, gmul,
                     cfg->clip ? cfg->clip_lo : -INFINITY, cfg->clip ? cfg->clip_hi : INFINITY};
}

/* An Adam tensor's staging: its weights as they are, its gradient times gmul, no clipping. */
static Staging adam_staging(const AdamTensor *x) {
    return (Staging){x->w, (x->kind & 2) ? x->low : NULL, x->g, x->kind & 1, 1.0f, x->gmul,
                     -INFINITY, INFINITY};
}

/* LAMB's scalars, as lamb_phase1/2 compute them. */
#define LAMB_SCALARS                                                                           \
    const float one_m_b1 = 1.0f - (float)cfg->beta1, beta2 = (float)cfg->beta2;               \
    const float one_m_b2 = 1.0f - beta2, eps = cfg->eps;                                       \
    const float inv_bc1 = 1.0f / (float)bc1, inv_bc2_sqrt = 1.0f / (float)bc2_sqrt;            \
    const float wd_g = cfg->mode == MODE_L2 ? (float)x->wd : 0.0f;                             \
    const float wd_u = cfg->mode == MODE_UPDATE ? (float)x->wd : 0.0f;                         \
    const Staging s = staging_of(x, cfg, cfg->mode == MODE_DECOUPLED ? decay : 1.0f, x->gmul); \
    const Stored st = STORED_OF(x)
#define LAMB_MOMENTS                                                                           \
    float w = wp[i] * wf;                                                                      \
    float gi = clampf(gp[i] * gm, glo, ghi) + wd_g * w;                                        \
    float m0 = mb[i], v0 = vb[i];                                                              \
    float mi = m0 + one_m_b1 * (gi - m0);                                                      \
    float vi = v0 * beta2 + one_m_b2 * gi * gi;                                                \
    float rv = sqrtf(vi);                                                                      \
    float u = (mi * inv_bc1) / (rv * inv_bc2_sqrt + eps) + wd_u * w;

#define LAMB_SUMS_LOOP                                                                         \
    _Pragma("omp simd reduction(+ : bw, bu)")                                                  \
    for (int64_t i = 0; i < len; i++) {                                                        \
        LAMB_MOMENTS                                                                           \
        bw += w * w;                                                                           \
        bu += u * u;                                                                           \
    }

TARGETS static void lamb_compact_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                      double bc1, double bc2_sqrt, float decay, double *out,
                                      const Keep *keep) {
    (void)keep; /* see lamb_compact_sums_v16 */
    LAMB_SCALARS;
    COMPACT_GRID(x);
    double sw = 0.0, su = 0.0;
    EACH_COMPACT_BLOCK(x, "omp parallel reduction(+ : sw, su) num_threads(cfg->nthreads) if (n >= 32768)",
        float bw = 0.0f, bu = 0.0f;
        LAMB_SUMS_LOOP
        sw += bw;
        su += bu;)
    out[0] = sw;
    out[1] = su;
}

#define LAMB_APPLY_LOOP                                                                        \
    _Pragma("omp simd reduction(max : am, av)")                                                \
    for (int64_t i = 0; i < len; i++) {                                                        \
        LAMB_MOMENTS                                                                           \
        wo[i] = w - lr * (ratio * u);                                                          \
        STAGE_MOMENTS                                                                          \
    }

TARGETS static void lamb_compact_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                       double bc1, double bc2_sqrt, float decay, float lr,
                                       float ratio, const Keep *keep) {
    (void)keep;
    LAMB_SCALARS;
    COMPACT_GRID(x);
    EACH_COMPACT_BLOCK(x, PARALLEL,
        float am = 0.0f, av = 0.0f;
        LAMB_APPLY_LOOP
        BLOCK_OUTPUTS(b, x);)
}

#define LANS_SCALARS                                                                           \
    const float one_m_b1 = 1.0f - (float)cfg->beta1, beta2 = (float)cfg->beta2;               \
    const float one_m_b2 = 1.0f - beta2, eps = cfg->eps, wd = (float)x->wd;                    \
    const float inv_bc1 = 1.0f / (float)bc1, inv_bc2_sqrt = 1.0f / (float)bc2_sqrt;            \
    const Staging s = staging_of(x, cfg, 1.0f, ginv);                                          \
    const Stored st = STORED_OF(x)
#define LANS_MOMENTS                                                                           \
    float w = wp[i] * wf;                                                                      \
    float gt = clampf(gp[i] * gm, glo, ghi);                                                   \
    float m0 = mb[i], v0 = vb[i];                                                              \
    float mi = m0 + one_m_b1 * (gt - m0);                                                      \
    float vi = v0 * beta2 + one_m_b2 * gt * gt;                                                \
    float rv = sqrtf(vi);                                                                      \
    float dinv = 1.0f / (rv * inv_bc2_sqrt + eps);                                             \
    float r = (mi * inv_bc1) * dinv + wd * w;

#define LANS_SUMS_LOOP                                                                         \
    _Pragma("omp simd reduction(+ : bw, br, bc, brc)")                                         \
    for (int64_t i = 0; i < len; i++) {                                                        \
        LANS_MOMENTS                                                                           \
        float c = gt * dinv + wd * w;                                                          \
        bw += w * w;                                                                           \
        br += r * r;                                                                           \
        bc += c * c;                                                                           \
        brc += r * c;                                                                          \
    }

TARGETS static void lans_compact_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                      double bc1, double bc2_sqrt, float ginv, double *out,
                                      const Keep *keep) {
    (void)keep;
    LANS_SCALARS;
    COMPACT_GRID(x);
    double sw = 0.0, sr = 0.0, sc = 0.0, src = 0.0;
    EACH_COMPACT_BLOCK(x, "omp parallel reduction(+ : sw, sr, sc, src) num_threads(cfg->nthreads) if (n >= 32768)",
        float bw = 0.0f, br = 0.0f, bc = 0.0f, brc = 0.0f;
        LANS_SUMS_LOOP
        sw += bw;
        sr += br;
        sc += bc;
        src += brc;)
    out[0] = sw;
    out[1] = sr;
    out[2] = sc;
    out[3] = src;
}

#define LANS_APPLY_LOOP                                                                        \
    _Pragma("omp simd reduction(max : am, av)")                                                \
    for (int64_t i = 0; i < len; i++) {                                                        \
        LANS_MOMENTS                                                                           \
        float w1 = w - lr_r * (ratio_r * r);                                                   \
        float c = gt * dinv + wd * (moved ? w1 : w);                                           \
        wo[i] = w1 - lr_c * (ratio_c * c);                                                     \
        STAGE_MOMENTS                                                                          \
    }

TARGETS static void lans_compact_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                       double bc1, double bc2_sqrt, float ginv, float lr_r,
                                       float lr_c,
                                       float ratio_r, float ratio_c, const Keep *keep) {
    (void)keep;
    LANS_SCALARS;
    COMPACT_GRID(x);
    const int moved = cfg->moved;
    EACH_COMPACT_BLOCK(x, PARALLEL,
        float am = 0.0f, av = 0.0f;
        LANS_APPLY_LOOP
        BLOCK_OUTPUTS(b, x);)
}

/* ---------------------------------------------------------------------------------------- */
/* Compact moments with AVX-512                                                               */
/* ---------------------------------------------------------------------------------------- */

/* The compact loops above, 16 lanes at a time with AVX-512 intrinsics, on CPUs that have it
 * (chosen at run time: compact_simd). The portable loops take a square root and a division
 * per element in each pass, and two more square roots to encode int8 codes: about 10 and 6
 * cycles per 16 lanes on the divider of current cores, where the float32 kernels wait on
 * memory instead. Here the update's square root and division are the 14-bit estimates of
 * 1/sqrt and 1/x (one cycle each), within 2^-14 of the exact values: the update within 2^-13
 * of the exact one, far inside the rounding of the stored moments themselves (2^-8 relative
 * in bfloat16, steps of 1.6% and more in int8). The moments are computed with the portable
 * loops' operations, so both store the same moments, and the codes need only estimates of
 * their roots (see code_signed): every implementation stores the same codes. The tail of a
 * block goes through the same instructions under a mask, so an element is computed alike
 * wherever its block starts in memory and a sharded run computes it as one process does.
 * Weights and gradients are staged as above; each block's new int8 moments wait in mb, vb
 * until the block's largest values are known, bfloat16 ones are rounded and stored at once.
 * LAMB and LANS keep the updates of each tensor's last blocks from the first pass to the second
 * (keep_take), where the second pass would compute them again. */
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_V16 1
#define V16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,bmi2")))
#define V16_INLINE static inline __attribute__((always_inline)) V16

static int v16_use = -1; /* -1: not yet asked */

static int v16_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("bmi2");
}

static int v16_on(void) {
    if (v16_use < 0) v16_use = v16_supported();
    return v16_use;
}

/* Whether the compact kernels run the AVX-512 loops: use < 0 asks, 0 picks the portable
 * loops, 1 the AVX-512 ones where the CPU has them. Returns the choice now in force. */
int32_t compact_simd(int32_t use) {
    if (use >= 0) v16_use = use && v16_supported();
    return v16_on();
}

#define V16_SET _mm512_set1_ps

/* sqrt(x), x >= 0, as x times the estimate of 1/sqrt(x); and 1/d, the estimate. Each within
 * 2^-14 (relative) of the exact value: the update within 2^-13 of the exact one, far inside
 * the rounding of the stored moments (steps of 2^-8 in bfloat16, at least 1.6% in int8). */
V16_INLINE __m512 v16_sqrt(__m512 x) {
    return _mm512_mul_ps(x, _mm512_rsqrt14_ps(_mm512_max_ps(x, V16_SET(FLT_MIN))));
}

V16_INLINE __m512 v16_recip(__m512 d) { return _mm512_rcp14_ps(d); }

/* Lanes [j, j + 16) of a block of len elements. */
V16_INLINE __mmask16 v16_mask(int64_t j, int64_t len) {
    return len - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - j)) - 1u);
}

/* The stored moments at element at (lanes k): int8 codes with the block's steps sm, sv
 * (s / 127^2, s / 1.875), as decode_block; or bfloat16. */
V16_INLINE void v16_decode(const Stored *st, int int8, int64_t at, __mmask16 k, __m512 sm,
                           __m512 sv, __m512 *m, __m512 *v) {
    if (int8) {
        const __m512 qm = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, (const int8_t *)st->m + at)));
        const __m512i qv =
            _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, (const uint8_t *)st->v + at));
        const __m512 fv = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_add_epi32(qv, _mm512_set1_epi32(FORMAT_CODE_OFFSET)),
                              FORMAT_CODE_SHIFT));
        *m = _mm512_mul_ps(_mm512_mul_ps(qm, _mm512_abs_ps(qm)), sm);
        *v = _mm512_mul_ps(_mm512_sub_ps(fv, V16_SET(FORMAT_CODE_LOW)), sv);
        return;
    }
    const __m512i hm = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)st->m + at));
    const __m512i hv = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)st->v + at));
    *m = _mm512_castsi512_ps(_mm512_slli_epi32(hm, 16));
    *v = _mm512_castsi512_ps(_mm512_slli_epi32(hv, 16));
}

/* The hashes (hash32) of index + lane + key, lanes 0 .. 15. */
V16_INLINE __m512i v16_hash32(int64_t index, uint32_t key) {
    const __m512i mul = _mm512_set1_epi32((int32_t)FORMAT_HASH_MUL);
    __m512i h = _mm512_add_epi32(_mm512_set1_epi32((int32_t)((uint32_t)index + key)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                   14, 15));
    h = _mm512_mullo_epi32(_mm512_xor_si512(_mm512_srli_epi32(h, 16), h), mul);
    h = _mm512_mullo_epi32(_mm512_xor_si512(_mm512_srli_epi32(h, 16), h), mul);
    return _mm512_xor_si512(_mm512_srli_epi32(h, 16), h);
}

/* The random bits (random16) of index + lane + key, lanes 0 .. 15. */
V16_INLINE __m512i v16_random16(int64_t index, uint32_t key) {
    return _mm512_and_si512(v16_hash32(index, key), _mm512_set1_epi32(0xFFFF));
}

/* x rounded to bfloat16 stochastically into out (lanes k), as round_stochastic with the
 * random bits of index + lane + key. */
V16_INLINE void v16_store_bf16(uint16_t *out, __mmask16 k, __m512 x, int64_t index,
                               uint32_t key) {
    const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(x), v16_random16(index, key));
    _mm256_mask_storeu_epi16(out, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

/* The signed codes of x with c = 127^2 / s (as int32), as code_signed: the root's estimate
 * y r is within 127 * 2^-14 of sqrt(y). Where it is not a number (y = 0, r infinite; a NaN
 * moment) the max takes 0.47 instead, and the code is 0. */
V16_INLINE __m512i v16_code_signed(__m512 x, __m512 c, __m512i unused) {
    (void)unused;
    const __m512 y = _mm512_mul_ps(_mm512_abs_ps(x), c);
    const __m512 t = _mm512_max_ps(
        _mm512_fmadd_ps(y, _mm512_rsqrt14_ps(y), V16_SET(FORMAT_ROOT_OFFSET)),
        V16_SET(FORMAT_ROOT_OFFSET));
    __m512 q = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 b = _mm512_add_ps(q, V16_SET(0.5f));
    q = _mm512_mask_add_ps(q, _mm512_cmp_ps_mask(_mm512_mul_ps(b, b), y, _CMP_LE_OQ), q,
                           V16_SET(1.0f));
    /* x's sign onto q (0xF8: q | (x & sign)) */
    const __m512i with_sign = _mm512_ternarylogic_epi32(
        _mm512_castps_si512(q), _mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u),
        0xF8);
    return _mm512_cvttps_epi32(_mm512_castsi512_ps(with_sign));
}

/* The unsigned codes of x with c = 1.875 / s, as code_unsigned with the random bits r16 (times
 * 16): the sum y + 2^-31 in its own rounding (an intrinsic with a rounding mode, which is
 * never fused with the product); a NaN takes 2^-31 from the max (code 0), and the unsigned
 * packs (V16_CODES64) saturate codes above 255 (y >= 2, infinity) to 255. */
V16_INLINE __m512i v16_code_unsigned(__m512 x, __m512 c, __m512i r16) {
    const __m512 low = V16_SET(FORMAT_CODE_LOW);
    const __m512 z = _mm512_max_ps(
        _mm512_add_round_ps(_mm512_mul_ps(x, c), low, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        low);
    const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(z), r16);
    return _mm512_sub_epi32(_mm512_srli_epi32(bits, FORMAT_CODE_SHIFT),
                            _mm512_set1_epi32(FORMAT_CODE_OFFSET));
}

/* The codes of x[0..n), n <= 64, into out[0..n): four vectors of int32 codes packed into one
 * of bytes (the packs work within 128-bit lanes: the permutation puts the four vectors'
 * elements back in order) and stored at once, which is cheaper than four narrowing stores. */
#define V16_LOAD_PART(x, n, t)                                                                 \
    _mm512_maskz_loadu_ps(v16_mask(16 * (t), (n) > 16 * (t) ? (n) : 16 * (t)), (x) + 16 * (t))
#define V16_CODES64(out, n, x, c, CODE, R0, R1, R2, R3, PACK16, PACK8)                         \
    do {                                                                                       \
        const __m512i q0 = CODE(V16_LOAD_PART(x, n, 0), c, R0);                                \
        const __m512i q1 = CODE(V16_LOAD_PART(x, n, 1), c, R1);                                \
        const __m512i q2 = CODE(V16_LOAD_PART(x, n, 2), c, R2);                                \
        const __m512i q3 = CODE(V16_LOAD_PART(x, n, 3), c, R3);                                \
        const __m512i bytes = _mm512_permutexvar_epi32(                                        \
            _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),           \
            PACK8(PACK16(q0, q1), PACK16(q2, q3)));                                           \
        if ((n) == 64)                                                                         \
            _mm512_storeu_si512((void *)(out), bytes);                                         \
        else                                                                                   \
            _mm512_mask_storeu_epi8((out), _bzhi_u64(~0ULL, (unsigned)(n)), bytes);            \
    } while (0)

/* The codes of x[j..j + n) (n <= 64; N: n, or 64 where that is known) from at. Unsigned
 * ones take the random bits of code_random16 (times 16): positions j .. j + 31 the halves of
 * the hashes of g + j/2 + lane, j + 32 .. j + 63 those of g + j/2 + 16 + lane. */
#define V16_LOW16(h) _mm512_and_si512(_mm512_slli_epi32(h, 4), _mm512_set1_epi32(0xFFFF0))
#define V16_HIGH16(h) _mm512_and_si512(_mm512_srli_epi32(h, 12), _mm512_set1_epi32(0xFFFF0))
#define V16_CODES_AT(N)                                                                        \
    do {                                                                                       \
        if (is_signed) {                                                                       \
            const __m512i none = _mm512_setzero_si512();                                       \
            V16_CODES64((int8_t *)codes + at + j, N, x + j, c, v16_code_signed, none, none,     \
                        none, none, _mm512_packs_epi32, _mm512_packs_epi16);                   \
        } else {                                                                               \
            const __m512i h0 = v16_hash32(offset + at + j / 2, key);                           \
            const __m512i h1 = v16_hash32(offset + at + j / 2 + 16, key);                      \
            V16_CODES64((uint8_t *)codes + at + j, N, x + j, c, v16_code_unsigned,             \
                        V16_LOW16(h0), V16_HIGH16(h0), V16_LOW16(h1), V16_HIGH16(h1),          \
                        _mm512_packus_epi32, _mm512_packus_epi16);                             \
        }                                                                                      \
    } while (0)

/* x[0..len) as block b of a moment's codes (from at), with the scale s (unsigned codes
 * rounded with the random bits of code_random16(offset + at + key, i)). A whole block runs
 * without masks. */
V16_INLINE void v16_encode(void *codes, float *scales, int is_signed, int64_t b, int64_t at,
                           int64_t len, const float *x, float s, int64_t offset, uint32_t key) {
    scales[b] = s;
    const __m512 c = V16_SET(code_factor(is_signed, s));
    if (len == COMPACT_BLOCK) {
        for (int64_t j = 0; j < COMPACT_BLOCK; j += 64) V16_CODES_AT(64);
        return;
    }
    for (int64_t j = 0; j < len; j += 64) {
        const int64_t n = len - j < 64 ? len - j : 64;
        V16_CODES_AT(n);
    }
}

/* Whole tensors (int8_encode) on AVX-512: each block's largest magnitude, then its codes. */
V16 static void int8_encode_v16(const float *x, void *codes, float *scales, int64_t rows,
                                int64_t row_len, int32_t is_signed, int64_t offset, uint32_t key,
                                int32_t nthreads) {
    const int64_t blocks = (row_len + COMPACT_BLOCK - 1) / COMPACT_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * row_len >= 65536)
    for (int64_t b = 0; b < rows * blocks; b++) {
        int64_t len;
        const int64_t at = block_start(b, blocks, row_len, &len);
        v16_encode(codes, scales, is_signed, b, at, len, x + at, block_max(x + at, len), offset,
                   key);
    }
}

/* Block b's int8 moments from mb, vb (len elements from at), with scales am, av. */
V16_INLINE void v16_encode_block(const Stored *st, int64_t b, int64_t at, int64_t len,
                                 const float *mb, const float *vb, float am, float av) {
    v16_encode(st->m, st->m_scale, 1, b, at, len, mb, am, st->offset, st->m_key);
    v16_encode(st->v, st->v_scale, 0, b, at, len, vb, av, st->offset, st->v_key);
}

/* What the AVX-512 loops of a tensor read: its operands and the update's scalars (those a
 * loop does not use are 0). Each thread works on a copy, in registers. */
typedef struct {
    Staging s;
    Stored st;
    void *w;       /* the tensor's weights (written) */
    uint16_t *low; /* as LayerwiseTensor */
    int split, in_place, moved, nesterov;
    int64_t per_row, row_len;
    float one_m_b1, one_m_b2, beta1, beta2, eps, inv_bc1, inv_bc2_sqrt;
    float wd_g, wd_u, wd;                 /* LAMB's decay into g or u; LANS's and Adam's */
    float lr, ratio, lr_r, lr_c, ratio_r, ratio_c; /* LAMB's and LANS's second pass */
    float decay, step_size;               /* Adam */
    float *keep;        /* the updates of blocks keep_block.. (from element keep_from) */
    int64_t keep_block, keep_from, keep_half; /* LANS: its second numbers from keep_half on */
} Blocks;

static Blocks blocks_of(void *w, uint16_t *low, int kind, int64_t row_len, Staging s,
                        Stored st) {
    Blocks c;
    memset(&c, 0, sizeof c);
    c.s = s;
    c.st = st;
    c.w = w;
    c.low = low;
    c.split = (kind & 2) != 0;
    c.in_place = !(kind & 2) && !low;
    c.row_len = row_len;
    c.per_row = (row_len + COMPACT_BLOCK - 1) / COMPACT_BLOCK;
    c.keep_block = INT64_MAX; /* none kept */
    return c;
}

/* A thread's blocks [first, last): the loop function NAME's head, up to the block's inputs:
 * wp, gp, where the new weights go (wo), and the steps sm, sv of its int8 codes. */
#define V16_BLOCKS(NAME)                                                                       \
    V16 static void NAME(const Blocks *blocks_, int64_t first, int64_t last, double *sums) {   \
        const Blocks c = *blocks_;                                                             \
        float wb[COMPACT_BLOCK], gb[COMPACT_BLOCK], mb[COMPACT_BLOCK], vb[COMPACT_BLOCK];      \
        const int int8 = c.st.form == FORM_INT8, plain = v16_plain(&c);                        \
        const __m512 vwf = V16_SET(c.s.wmul), vgm = V16_SET(c.s.gmul);                         \
        const __m512 vglo = V16_SET(c.s.glo), vghi = V16_SET(c.s.ghi);                         \
        const __m512 vomb1 = V16_SET(c.one_m_b1), vomb2 = V16_SET(c.one_m_b2);                 \
        const __m512 vbeta2 = V16_SET(c.beta2), veps = V16_SET(c.eps);                         \
        const __m512 vibc1 = V16_SET(c.inv_bc1), vibc2 = V16_SET(c.inv_bc2_sqrt);              \
        (void)sums; (void)mb; (void)vb; (void)vibc1; (void)plain;                              \
        for (int64_t b = first; b < last; b++) {                                               \
            int64_t len;                                                                       \
            const int64_t at = block_start(b, c.per_row, c.row_len, &len);                     \
            const float *wp = (const float *)c.s.w + at, *gp = (const float *)c.s.g + at;      \
            if (c.s.lo) stage_w(&c.s, at, len, wb), wp = wb;                                   \
            if (c.s.g_bf16) stage_g(&c.s, at, len, gb), gp = gb;                               \
            float *wo = c.in_place ? (float *)c.w + at : wb;                                   \
            const __m512 sm = V16_SET(int8 ? c.st.m_scale[b] / FORMAT_SIGNED_SCALE : 0.0f);    \
            const __m512 sv = V16_SET(int8 ? c.st.v_scale[b] / FORMAT_UNSIGNED_SCALE : 0.0f);  \
            (void)wo;
#define V16_BLOCKS_END                                                                         \
        }                                                                                      \
    }

/* A block's lanes j .. j + 15 (mask k): w and the gradient gt as the portable loops take
 * them (wp * wf, clamp(gp * gm, glo, ghi)); PLAIN (a constant) where wf is 1 and the bounds
 * are infinite, and these are the identity. */
#define V16_W(PLAIN)                                                                           \
    const __m512 w0 = _mm512_maskz_loadu_ps(k, wp + j);                                        \
    const __m512 w = (PLAIN) ? w0 : _mm512_mul_ps(w0, vwf)
#define V16_GT(PLAIN)                                                                          \
    const __m512 g0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, gp + j), vgm);                    \
    const __m512 gt = (PLAIN) ? g0 : _mm512_min_ps(vghi, _mm512_max_ps(vglo, g0))

/* Whether a Blocks' weights are taken as they are and its gradient is not clipped. */
static int v16_plain(const Blocks *c) {
    return c->s.wmul == 1.0f && c->s.glo == -INFINITY && c->s.ghi == INFINITY;
}

/* A block's lanes, 16 at a time: w, gt, and the stored moments m0, v0 (PLAIN, INT8 and the
 * length LEN constants where they are known). */
#define V16_CHUNKS(PLAIN, INT8, LEN, ...)                                                      \
    for (int64_t j = 0; j < (LEN); j += 16) {                                                  \
        const __mmask16 k = v16_mask(j, (LEN));                                                \
        V16_W(PLAIN);                                                                          \
        V16_GT(PLAIN);                                                                         \
        __m512 m0, v0;                                                                         \
        v16_decode(&c.st, (INT8), at + j, k, sm, sv, &m0, &v0);                                \
        __VA_ARGS__                                                                            \
    }

/* Over a block's lanes: a whole block of int8 codes with plain weights and gradients (the
 * common case) runs a copy of the loop in which all that is constant (no masks, no scaling
 * of w, no clamp, one form); the others the general one. */
#define V16_EACH_CHUNK(...)                                                                    \
    if (int8 && len == COMPACT_BLOCK && plain) {                                               \
        V16_CHUNKS(1, 1, COMPACT_BLOCK, __VA_ARGS__)                                           \
    } else {                                                                                   \
        V16_CHUNKS(0, int8, len, __VA_ARGS__)                                                  \
    }

/* The new moments mi, vi staged: int8 ones in mb, vb with their largest magnitudes in am, av
 * (NaNs passed over), bfloat16 ones stored. */
#define V16_STAGE_MOMENTS                                                                      \
    if (int8) {                                                                                \
        _mm512_storeu_ps(mb + j, mi);                                                          \
        _mm512_storeu_ps(vb + j, vi);                                                          \
        am = _mm512_mask_max_ps(am, k, _mm512_abs_ps(mi), am);                                 \
        av = _mm512_mask_max_ps(av, k, vi, av);                                                \
    } else {                                                                                   \
        v16_store_bf16((uint16_t *)c.st.m + at + j, k, mi, c.st.offset + at + j, c.st.m_key); \
        v16_store_bf16((uint16_t *)c.st.v + at + j, k, vi, c.st.offset + at + j, c.st.v_key); \
    }
#define V16_MAXIMA __m512 am = _mm512_setzero_ps(), av = _mm512_setzero_ps()
/* After a block's loop: its new weights, where they were staged; its int8 moments, kept in
 * mb, vb. */
#define V16_UNSTAGE                                                                            \
    if (!c.in_place) unstage_w(c.w, c.low, c.split, at, len, wb)
#define V16_STORE_MOMENTS                                                                      \
    if (int8)                                                                                  \
        v16_encode_block(&c.st, b, at, len, mb, vb, _mm512_reduce_max_ps(am),                  \
                         _mm512_reduce_max_ps(av))
#define V16_BLOCK_OUTPUTS                                                                      \
    V16_UNSTAGE;                                                                               \
    V16_STORE_MOMENTS

/* The moments' update from the gradient G with the operations the portable loops compile to
 * (so that both store the same moments), and 1/(sqrt(v^) + eps). */
#define V16_MOMENTS(G)                                                                         \
    const __m512 mi = _mm512_fmadd_ps(vomb1, _mm512_sub_ps(G, m0), m0);                        \
    const __m512 vi = _mm512_fmadd_ps(v0, vbeta2, _mm512_mul_ps(_mm512_mul_ps(vomb2, G), G));  \
    V16_DINV
#define V16_DINV const __m512 dinv = v16_recip(_mm512_fmadd_ps(v16_sqrt(vi), vibc2, veps))

/* LAMB: the update u. */
#define V16_LAMB_U                                                                             \
    const __m512 gi = _mm512_fmadd_ps(vwd_g, w, gt);                                           \
    V16_MOMENTS(gi);                                                                           \
    const __m512 u = _mm512_fmadd_ps(_mm512_mul_ps(mi, vibc1), dinv, _mm512_mul_ps(vwd_u, w))

/* LAMB's first pass. Blocks from c.keep_block on (the end of the tensor, where the second
 * pass starts) also store their new moments and keep their updates in c.keep, so that the
 * second pass only writes their weights; the others only add up the norms. */
V16_BLOCKS(lamb_sums_blocks)
    const __m512 vwd_g = V16_SET(c.wd_g), vwd_u = V16_SET(c.wd_u);
    __m512 bw = _mm512_setzero_ps(), bu = _mm512_setzero_ps();
    if (b < c.keep_block) {
        V16_EACH_CHUNK(
            V16_LAMB_U;
            bw = _mm512_mask3_fmadd_ps(w, w, bw, k);
            bu = _mm512_mask3_fmadd_ps(u, u, bu, k);)
    } else {
        float *keep = c.keep + (at - c.keep_from);
        V16_MAXIMA;
        V16_EACH_CHUNK(
            V16_LAMB_U;
            bw = _mm512_mask3_fmadd_ps(w, w, bw, k);
            bu = _mm512_mask3_fmadd_ps(u, u, bu, k);
            _mm512_mask_storeu_ps(keep + j, k, u);
            V16_STAGE_MOMENTS)
        V16_STORE_MOMENTS;
    }
    sums[0] += _mm512_reduce_add_ps(bw);
    sums[1] += _mm512_reduce_add_ps(bu);
V16_BLOCKS_END

V16_BLOCKS(lamb_apply_blocks)
    const __m512 vwd_g = V16_SET(c.wd_g), vwd_u = V16_SET(c.wd_u);
    const __m512 vlr = V16_SET(c.lr), vratio = V16_SET(c.ratio);
    if (b >= c.keep_block) { /* the update kept by the first pass; the moments are stored */
        const float *keep = c.keep + (at - c.keep_from);
        for (int64_t j = 0; j < len; j += 16) {
            const __mmask16 k = v16_mask(j, len);
            V16_W(0);
            const __m512 u = _mm512_maskz_loadu_ps(k, keep + j);
            _mm512_mask_storeu_ps(wo + j, k, _mm512_fnmadd_ps(vlr, _mm512_mul_ps(vratio, u), w));
        }
        V16_UNSTAGE;
        continue;
    }
    V16_MAXIMA;
    V16_EACH_CHUNK(
        V16_LAMB_U;
        _mm512_mask_storeu_ps(wo + j, k, _mm512_fnmadd_ps(vlr, _mm512_mul_ps(vratio, u), w));
        V16_STAGE_MOMENTS)
    V16_BLOCK_OUTPUTS;
V16_BLOCKS_END

/* LANS: the update r, and the normalised gradient's 1/(sqrt(v^) + eps) scaled part. */
#define V16_LANS_R                                                                             \
    V16_MOMENTS(gt);                                                                           \
    const __m512 r = _mm512_fmadd_ps(_mm512_mul_ps(mi, vibc1), dinv, _mm512_mul_ps(vwd, w))

/* LANS's sums of a block's lanes (r, and cc of the weights before the step). */
#define V16_LANS_SUMS                                                                          \
    const __m512 cc = _mm512_fmadd_ps(gt, dinv, _mm512_mul_ps(vwd, w));                       \
    bw = _mm512_mask3_fmadd_ps(w, w, bw, k);                                                   \
    br = _mm512_mask3_fmadd_ps(r, r, br, k);                                                   \
    bc = _mm512_mask3_fmadd_ps(cc, cc, bc, k);                                                 \
    brc = _mm512_mask3_fmadd_ps(r, cc, brc, k)

/* LANS's first pass; blocks from c.keep_block on also store their moments and keep r and
 * 1/(sqrt(v^) + eps) in c.keep (the first and second half), as lamb_sums_blocks. */
V16_BLOCKS(lans_sums_blocks)
    const __m512 vwd = V16_SET(c.wd);
    __m512 bw = _mm512_setzero_ps(), br = bw, bc = bw, brc = bw;
    if (b < c.keep_block) {
        V16_EACH_CHUNK(
            V16_LANS_R;
            V16_LANS_SUMS;)
    } else {
        float *keep = c.keep + (at - c.keep_from);
        V16_MAXIMA;
        V16_EACH_CHUNK(
            V16_LANS_R;
            V16_LANS_SUMS;
            _mm512_mask_storeu_ps(keep + j, k, r);
            _mm512_mask_storeu_ps(keep + c.keep_half + j, k, dinv);
            V16_STAGE_MOMENTS)
        V16_STORE_MOMENTS;
    }
    sums[0] += _mm512_reduce_add_ps(bw);
    sums[1] += _mm512_reduce_add_ps(br);
    sums[2] += _mm512_reduce_add_ps(bc);
    sums[3] += _mm512_reduce_add_ps(brc);
V16_BLOCKS_END

/* LANS's weights from r and dinv. */
#define V16_LANS_WEIGHTS                                                                       \
    const __m512 w1 = _mm512_fnmadd_ps(vlr_r, _mm512_mul_ps(vratio_r, r), w);                  \
    const __m512 cc = _mm512_fmadd_ps(gt, dinv, _mm512_mul_ps(vwd, c.moved ? w1 : w));         \
    _mm512_mask_storeu_ps(wo + j, k, _mm512_fnmadd_ps(vlr_c, _mm512_mul_ps(vratio_c, cc), w1))

V16_BLOCKS(lans_apply_blocks)
    const __m512 vwd = V16_SET(c.wd), vlr_r = V16_SET(c.lr_r), vlr_c = V16_SET(c.lr_c);
    const __m512 vratio_r = V16_SET(c.ratio_r), vratio_c = V16_SET(c.ratio_c);
    if (b >= c.keep_block) { /* r and dinv kept by the first pass; the moments are stored */
        const float *keep = c.keep + (at - c.keep_from);
        for (int64_t j = 0; j < len; j += 16) {
            const __mmask16 k = v16_mask(j, len);
            V16_W(0);
            V16_GT(0);
            const __m512 r = _mm512_maskz_loadu_ps(k, keep + j);
            const __m512 dinv = _mm512_maskz_loadu_ps(k, keep + c.keep_half + j);
            V16_LANS_WEIGHTS;
        }
        V16_UNSTAGE;
        continue;
    }
    V16_MAXIMA;
    V16_EACH_CHUNK(
        V16_LANS_R;
        V16_LANS_WEIGHTS;
        V16_STAGE_MOMENTS)
    V16_BLOCK_OUTPUTS;
V16_BLOCKS_END

/* Adam (adam_compact): w * decay - step_size * n / (sqrt(v) / bc2_sqrt + eps). The moments
 * with torch's operations, unfused (the intrinsics are vector arithmetic, which GCC would
 * otherwise fuse). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
V16_BLOCKS(adam_blocks)
    const __m512 vbeta1 = V16_SET(c.beta1), vwd = V16_SET(c.wd);
    const __m512 vdecay = V16_SET(c.decay), vstep = V16_SET(c.step_size);
    V16_MAXIMA;
    V16_EACH_CHUNK(
        const __m512 gi = _mm512_add_ps(gt, _mm512_mul_ps(vwd, w));
        const __m512 mi = _mm512_add_ps(m0, _mm512_mul_ps(vomb1, _mm512_sub_ps(gi, m0)));
        const __m512 vi = _mm512_add_ps(_mm512_mul_ps(v0, vbeta2),
                                        _mm512_mul_ps(_mm512_mul_ps(vomb2, gi), gi));
        V16_DINV;
        const __m512 num = c.nesterov ? _mm512_fmadd_ps(vbeta1, mi, _mm512_mul_ps(vomb1, gi)) : mi;
        _mm512_mask_storeu_ps(wo + j, k, _mm512_fnmadd_ps(vstep, _mm512_mul_ps(num, dinv),
                                                          _mm512_mul_ps(w, vdecay)));
        V16_STAGE_MOMENTS)
    V16_BLOCK_OUTPUTS;
V16_BLOCKS_END
#pragma GCC pop_options

/* fn over a tensor's n elements in blocks, each thread a contiguous share of them; its sums
 * (nsums of them) totalled in the threads' order, so that a run gives the same ones every
 * time. */
static void v16_run(void (*fn)(const Blocks *, int64_t, int64_t, double *), const Blocks *c,
                    int64_t n, int nthreads, double *sums, int nsums) {
    const int64_t total = c->row_len > 0 ? n / c->row_len * c->per_row : 0;
    if (nthreads < 1) nthreads = 1;
    double part[nthreads][4];
    memset(part, 0, sizeof part);
    int used = 1;
#pragma omp parallel num_threads(nthreads) if (n >= 32768)
    {
        const int id = omp_get_thread_num(), nt = omp_get_num_threads();
        if (id == 0) used = nt;
        fn(c, total * id / nt, total * (id + 1) / nt, part[id]);
    }
    for (int i = 0; i < nsums; i++) {
        sums[i] = 0.0;
        for (int t = 0; t < used; t++) sums[i] += part[t][i];
    }
}

/* A LAMB or LANS tensor's Blocks, with the moments' scalars their *_SCALARS computed. */
#define LAYERWISE_BLOCKS(x)                                                                    \
    Blocks c = blocks_of((x)->w, (x)->low, (x)->kind, (x)->row_len, s, st);                    \
    c.one_m_b1 = one_m_b1, c.one_m_b2 = one_m_b2, c.beta2 = beta2, c.eps = eps;                \
    c.inv_bc1 = inv_bc1, c.inv_bc2_sqrt = inv_bc2_sqrt

/* The kept updates (lamb_sums_blocks, lans_sums_blocks): one buffer for the process, of up
 * to KEEP_CAP floats, held by one *_multi call at a time. It covers the last elements of each
 * tensor, as many as it holds (half as many for LANS, which keeps two numbers per element).
 * Only *_multi, which runs both passes of a tensor back to back, keeps; the sharded calls
 * (*_multi_sums, then *_multi_apply) compute the updates again. */
static float *keep_buffer;
static int64_t keep_floats;
static char keep_busy;

/* The buffer for the updates of the compact tensors of ts, floats per element: as large as
 * the largest needs, up to KEEP_CAP (grown, never shrunk). NULL where nothing is compact,
 * where another call holds it, or where the AVX-512 loops do not run. */
static const Keep *keep_take(const LayerwiseTensor *ts, int64_t count, int64_t floats,
                             Keep *keep) {
    int64_t need = 0;
    for (int64_t t = 0; t < count; t++)
        if (ts[t].form != FORM_F32 && ts[t].n * floats > need) need = ts[t].n * floats;
    need = need < KEEP_CAP ? need : KEEP_CAP;
    if (need == 0 || !v16_on() || __atomic_test_and_set(&keep_busy, __ATOMIC_ACQUIRE))
        return NULL;
    if (keep_floats < need) {
        free(keep_buffer);
        keep_buffer = (float *)malloc(need * sizeof(float));
        keep_floats = keep_buffer ? need : 0;
    }
    if (!keep_buffer) {
        __atomic_clear(&keep_busy, __ATOMIC_RELEASE);
        return NULL;
    }
    *keep = (Keep){keep_buffer, keep_floats};
    return keep;
}

static void keep_give(const Keep *keep) {
    if (keep) __atomic_clear(&keep_busy, __ATOMIC_RELEASE);
}

/* The blocks of a tensor of n elements whose updates fit in keep, each taking floats floats:
 * its last blocks from the first that starts at or after n - keep->size / floats (the second
 * numbers from keep->size / 2 on). */
static void keep_range(Blocks *c, int64_t n, const Keep *keep, int64_t floats) {
    if (!keep || c->row_len <= 0) return;
    const int64_t cap = keep->size / floats, total = n / c->row_len * c->per_row;
    const int64_t start = n > cap ? n - cap : 0;
    const int64_t r = start / c->row_len, o = start % c->row_len;
    int64_t len;
    c->keep = keep->at;
    c->keep_half = keep->size / 2;
    c->keep_block = r * c->per_row + (o + COMPACT_BLOCK - 1) / COMPACT_BLOCK;
    c->keep_from = c->keep_block < total ? block_start(c->keep_block, c->per_row, c->row_len, &len) : n;
}

/* The Blocks of a LAMB tensor: the scalars of LAMB_SCALARS, the updates it keeps in keep. */
static Blocks lamb_blocks(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                          double bc2_sqrt, float decay, const Keep *keep) {
    LAMB_SCALARS;
    LAYERWISE_BLOCKS(x);
    c.wd_g = wd_g, c.wd_u = wd_u;
    keep_range(&c, x->n, keep, 1);
    return c;
}

static void lamb_compact_sums_v16(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                  double bc1, double bc2_sqrt, float decay, double *out,
                                  const Keep *keep) {
    const Blocks c = lamb_blocks(x, cfg, bc1, bc2_sqrt, decay, keep);
    v16_run(lamb_sums_blocks, &c, x->n, cfg->nthreads, out, 2);
}

static void lamb_compact_apply_v16(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                   double bc1, double bc2_sqrt, float decay, float lr,
                                   float ratio, const Keep *keep) {
    Blocks c = lamb_blocks(x, cfg, bc1, bc2_sqrt, decay, keep);
    c.lr = lr, c.ratio = ratio;
    v16_run(lamb_apply_blocks, &c, x->n, cfg->nthreads, NULL, 0);
}

/* The Blocks of a LANS tensor (LANS_SCALARS), keeping two numbers per element. */
static Blocks lans_blocks(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                          double bc2_sqrt, float ginv, const Keep *keep) {
    LANS_SCALARS;
    LAYERWISE_BLOCKS(x);
    c.wd = wd, c.moved = cfg->moved;
    keep_range(&c, x->n, keep, 2);
    return c;
}

static void lans_compact_sums_v16(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                  double bc1, double bc2_sqrt, float ginv, double *out,
                                  const Keep *keep) {
    const Blocks c = lans_blocks(x, cfg, bc1, bc2_sqrt, ginv, keep);
    v16_run(lans_sums_blocks, &c, x->n, cfg->nthreads, out, 4);
}

static void lans_compact_apply_v16(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                                   double bc1, double bc2_sqrt, float ginv, float lr_r,
                                   float lr_c,
                                   float ratio_r, float ratio_c, const Keep *keep) {
    Blocks c = lans_blocks(x, cfg, bc1, bc2_sqrt, ginv, keep);
    c.lr_r = lr_r, c.lr_c = lr_c, c.ratio_r = ratio_r, c.ratio_c = ratio_c;
    v16_run(lans_apply_blocks, &c, x->n, cfg->nthreads, NULL, 0);
}

static void adam_compact_v16(const AdamTensor *x, const AdamConfig *cfg) {
    Blocks c = blocks_of(x->w, x->low, x->kind, x->row_len, adam_staging(x), STORED_OF(x));
    c.one_m_b1 = cfg->one_m_b1, c.one_m_b2 = cfg->one_m_b2, c.beta1 = cfg->beta1;
    c.beta2 = cfg->beta2, c.eps = cfg->eps, c.inv_bc2_sqrt = 1.0f / x->bc2_sqrt;
    c.wd = x->wd_l2, c.decay = x->decay, c.step_size = x->step_size;
    c.nesterov = cfg->nesterov;
    v16_run(adam_blocks, &c, x->n, cfg->nthreads, NULL, 0);
}

#define COMPACT_CALL(FN, ARGS) (v16_on() ? FN##_v16 ARGS : FN ARGS)
#else
int32_t compact_simd(int32_t use) {
    (void)use;
    return 0;
}
static const Keep *keep_take(const LayerwiseTensor *ts, int64_t count, int64_t floats,
                             Keep *keep) {
    (void)ts, (void)count, (void)floats, (void)keep;
    return NULL;
}
static void keep_give(const Keep *keep) { (void)keep; }
#define COMPACT_CALL(FN, ARGS) FN ARGS
#endif

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

/* Adam on compact moments (see the LAMB section above): one pass, block by block. */
#define ADAM_COMPACT_LOOP(NUM, DENOM)                                                          \
    _Pragma("omp simd reduction(max : am, av)")                                                \
    for (int64_t i = 0; i < len; i++) {                                                        \
        float w = wp[i];                                                                       \
        float gi = gp[i] * gm + wd_l2 * w;                                                     \
        float m0 = mb[i], v0 = vb[i];                                                          \
        float mi = m0 + one_m_b1 * (gi - m0);                                                  \
        float vi = v0 * beta2 + one_m_b2 * gi * gi;                                            \
        float rv = sqrtf(vi);                                                                  \
        wo[i] = w * decay - step_size * ((NUM) / (DENOM));                                     \
        STAGE_MOMENTS                                                                          \
    }

TARGETS static void adam_compact(const AdamTensor *x, const AdamConfig *cfg) {
    const float one_m_b1 = cfg->one_m_b1, beta1 = cfg->beta1, beta2 = cfg->beta2;
    const float one_m_b2 = cfg->one_m_b2, eps = cfg->eps, wd_l2 = x->wd_l2, decay = x->decay;
    const float step_size = x->step_size, bc2_sqrt = x->bc2_sqrt, inv_bc2_sqrt = 1.0f / bc2_sqrt;
    const int split = (x->kind & 2) != 0, nesterov = cfg->nesterov;
    const Staging s = adam_staging(x);
    const Stored st = STORED_OF(x);
    COMPACT_GRID(x);
    EACH_COMPACT_BLOCK(x, PARALLEL,
        float am = 0.0f, av = 0.0f;
        if (nesterov && split) {
            ADAM_COMPACT_LOOP(beta1 * mi + one_m_b1 * gi, DENOM_FAST)
        } else if (nesterov) {
            ADAM_COMPACT_LOOP(beta1 * mi + one_m_b1 * gi, DENOM_EXACT)
        } else if (split) {
            ADAM_COMPACT_LOOP(mi, DENOM_FAST)
        } else {
            ADAM_COMPACT_LOOP(mi, DENOM_EXACT)
        }
        BLOCK_OUTPUTS(b, x);)
}

/* One Adam step on each of `count` tensors (see AdamTensor); step[t] is incremented. */
void adam_multi(const AdamTensor *ts, int64_t count, const AdamConfig *cfg) {
    for (int64_t t = 0; t < count; t++) {
        const AdamTensor *x = &ts[t];
        *x->step += 1.0f; /* the state's step counter (a float32 scalar tensor) */
        if (x->form != FORM_F32) {
            COMPACT_CALL(adam_compact, (x, cfg));
            continue;
        }
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

/* keep: where the AVX-512 loops may keep updates between the two passes (keep_take), or NULL. */
static void lamb_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double *sums,
                      const Keep *keep) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 1, cfg, &bc1, &bc2_sqrt);
    const float decay = (float)(1.0 - x->lr * x->wd);
    if (x->form != FORM_F32) {
        COMPACT_CALL(lamb_compact_sums, (x, cfg, bc1, bc2_sqrt, decay, sums, keep));
        return;
    }
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

static void lamb_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg, const double *sums,
                       const Keep *keep) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 0, cfg, &bc1, &bc2_sqrt);
    const float decay = (float)(1.0 - x->lr * x->wd);
    const double ratio = x->adapt ? trust_ratio(sums[0], sums[1], cfg) : 1.0;
    if (x->form != FORM_F32) {
        COMPACT_CALL(lamb_compact_apply,
                     (x, cfg, bc1, bc2_sqrt, decay, (float)x->lr, (float)ratio, keep));
        return;
    }
    lamb_phase2(x->w, x->m, x->v, x->n, (float)bc1, (float)bc2_sqrt, cfg->eps, (float)x->wd,
                cfg->mode, decay, (float)x->lr, (float)ratio, x->low, (x->kind & 2) != 0,
                cfg->nthreads);
}

void lamb_multi(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg) {
    double sums[2];
    Keep buffer;
    const Keep *keep = keep_take(ts, count, 1, &buffer);
    for (int64_t t = 0; t < count; t++) {
        lamb_sums(&ts[t], cfg, sums, keep);
        lamb_apply(&ts[t], cfg, sums, keep);
    }
    keep_give(keep);
}

/* sums[2t], sums[2t + 1]: ||w||^2 and ||u||^2 of tensor t (of its local piece). */
void lamb_multi_sums(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                     double *sums) {
    for (int64_t t = 0; t < count; t++) lamb_sums(&ts[t], cfg, sums + 2 * t, NULL);
}

/* The tensors in the order opposite to the sums pass, which left the last ones in the caches. */
void lamb_multi_apply(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                      const double *sums) {
    for (int64_t t = count - 1; t >= 0; t--) lamb_apply(&ts[t], cfg, sums + 2 * t, NULL);
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
                      double *sums, const Keep *keep) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 1, cfg, &bc1, &bc2_sqrt);
    if (x->form != FORM_F32) {
        COMPACT_CALL(lans_compact_sums, (x, cfg, bc1, bc2_sqrt, ginv, sums, keep));
        return;
    }
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
                       const double *sums, const Keep *keep) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 0, cfg, &bc1, &bc2_sqrt);
    const double lr_r = x->lr * cfg->beta1, lr_c = x->lr * (1.0 - cfg->beta1);
    double c2 = sums[2];
    const double ratio_r = x->adapt ? trust_ratio(sums[0], sums[1], cfg) : 1.0;
    if (cfg->moved) { /* c' = c - wd*lr_r*ratio_r*r: ||c'||^2 from the sums of phase 1 */
        const double k = x->wd * lr_r * ratio_r;
        c2 = c2 - 2.0 * k * sums[3] + k * k * sums[1];
        if (c2 < 0.0) c2 = 0.0;
    }
    const double ratio_c = x->adapt ? trust_ratio(sums[0], c2, cfg) : 1.0;
    if (x->form != FORM_F32) {
        COMPACT_CALL(lans_compact_apply, (x, cfg, bc1, bc2_sqrt, ginv, (float)lr_r,
                                          (float)lr_c, (float)ratio_r, (float)ratio_c, keep));
        return;
    }
#define CALL_LANS_PHASE2(FN, GT)                                                               \
    FN(x->w, (const GT *)x->g, x->m, x->v, x->n, ginv, cfg->clip_lo, cfg->clip_hi, cfg->clip,  \
       (float)bc1, (float)bc2_sqrt, cfg->eps, (float)x->wd, (float)lr_r, (float)lr_c,          \
       (float)ratio_r, (float)ratio_c, cfg->moved, x->low, (x->kind & 2) != 0, cfg->nthreads)
    if (x->kind & 1)
        CALL_LANS_PHASE2(lans_phase2_bf16g, uint16_t);
    else
        CALL_LANS_PHASE2(lans_phase2, float);
#undef CALL_LANS_PHASE2
}

void lans_multi(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg) {
    double sums[4];
    Keep buffer;
    const Keep *keep = keep_take(ts, count, 2, &buffer);
    for (int64_t t = 0; t < count; t++) {
        const float ginv = lans_ginv(&ts[t], cfg);
        lans_sums(&ts[t], cfg, ginv, sums, keep);
        lans_apply(&ts[t], cfg, ginv, sums, keep);
    }
    keep_give(keep);
}

/* sums[4t .. 4t + 3]: ||w||^2, ||r||^2, ||c||^2 and <c, r> of tensor t (of its local piece);
 * ts[t].gsq must hold the whole gradient's sum of squares. Each pass over all tensors goes in
 * the order opposite to the one before (gradients' sums ascending, these descending, apply
 * ascending), so that it starts on the data the previous one left in the caches. */
void lans_multi_sums(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                     double *sums) {
    /* the gradients' sums were taken in ascending order: start where they ended */
    for (int64_t t = count - 1; t >= 0; t--)
        lans_sums(&ts[t], cfg, lans_ginv(&ts[t], cfg), sums + 4 * t, NULL);
}

void lans_multi_apply(const LayerwiseTensor *ts, int64_t count, const LayerwiseConfig *cfg,
                      const double *sums) {
    for (int64_t t = 0; t < count; t++)
        lans_apply(&ts[t], cfg, lans_ginv(&ts[t], cfg), sums + 4 * t, NULL);
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

/* ---- compact optimizer state: whole tensors (scaleopt._compact's conversions) ------------ */

/* Opens the loop over the blocks of rows x row_len, in parallel: block b, its first element
 * at, its length len. */
#define EACH_BLOCK(rows, row_len)                                                              \
    const int64_t blocks = ((row_len) + COMPACT_BLOCK - 1) / COMPACT_BLOCK;                   \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (rows * row_len >= 65536)") \
    for (int64_t b = 0; b < (rows) * blocks; b++)                                              \
        for (int64_t len = 0, at = block_start(b, blocks, row_len, &len), once = 1; once; once = 0)

TARGETS void int8_encode(const float *x, void *codes, float *scales, int64_t rows,
                         int64_t row_len, int32_t is_signed, int64_t offset, int64_t key,
                         int32_t nthreads) {
#ifdef HAVE_V16
    if (v16_on()) {
        int8_encode_v16(x, codes, scales, rows, row_len, is_signed, offset, (uint32_t)key,
                        nthreads);
        return;
    }
#endif
    EACH_BLOCK(rows, row_len) {
        encode_block(codes, scales, FORM_INT8, is_signed, b, at, len, x + at,
                     block_max(x + at, len), offset, (uint32_t)key);
    }
}

TARGETS void int8_decode(const void *codes, const float *scales, float *x, int64_t rows,
                         int64_t row_len, int32_t is_signed, int32_t nthreads) {
    EACH_BLOCK(rows, row_len) {
        decode_block(codes, scales, FORM_INT8, is_signed, b, at, len, x + at);
    }
}

TARGETS void bf16_round_stochastic(const float *x, uint16_t *out, int64_t n, int64_t offset,
                                   int64_t key, int32_t nthreads) {
#pragma omp parallel for simd num_threads(nthreads) schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) out[i] = round_stochastic(x[i], (uint32_t)(offset + i) + (uint32_t)key);
}
