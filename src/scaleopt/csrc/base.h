/* The platform (OpenMP, the CPU's clones), the tensors' and calls' structs, and the
 * conversions: bfloat16, split masters.
 * Part of kernels.c, which includes the parts in order as one translation unit. */

#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_format.h" /* the compact format's constants (scaleopt/_format.py) */
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

/* weight-decay modes (LAMB): MODE_UPDATE, MODE_DECOUPLED, MODE_L2 (_format.h) */

/* The arguments of the multi-tensor calls, one struct per tensor and one per call. Their
 * ctypes mirrors are in _native.py; struct_layout() below lets a test compare the two. */

/* What every multi-tensor kernel reads of a tensor. kind: KIND_BF16_GRAD = bfloat16 gradient,
 * KIND_SPLIT = split master (w the bfloat16 upper halves, w16 the int16 lower halves); otherwise w is the
 * float32 weight and w16 an optional bfloat16 copy to write in the same pass. */
#define TENSOR_FIELDS                                                                          \
    void *w;          /* float32 weight, or a split master's bfloat16 upper halves */        \
    const void *g;    /* float32 or bfloat16 gradient */                                     \
    void *m;          /* first moment: float32, or as COMPACT_FIELDS say */                   \
    void *v;          /* second moment: likewise */                                           \
    uint16_t *w16;    /* the weight's 16 bits (see kind); NULL for none */                    \
    float *step;      /* the step counter (a float32 scalar), incremented */                 \
    int64_t n;        /* elements */                                                         \
    int32_t kind;                                                                              \
    float gmul;       /* the scalar the gradient is taken times */

/* The moments' storage (scaleopt._compact): form FORM_FLOAT32 (m and v are float32), FORM_BFLOAT16
 * (bfloat16) or FORM_INT8 (m int8 codes, v uint8 codes, with float32 scales, one per block of
 * 256 within a row). The compact forms are read and written block by block inside the update's
 * passes, with no float32 copy of the moments. */
#define COMPACT_FIELDS                                                                         \
    float *m_scale, *v_scale; /* FORM_INT8: the scales, rows x blocks */                      \
    int64_t row_len;          /* FORM_INT8: elements per row; FORM_BFLOAT16: n */                 \
    int64_t offset;           /* FORM_BFLOAT16: element 0's index in the whole tensor */          \
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
    FIELD(S, w), FIELD(S, g), FIELD(S, m), FIELD(S, v), FIELD(S, w16), FIELD(S, step),         \
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

