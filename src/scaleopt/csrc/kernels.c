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
 * backwards() in loops.h). LAMB moves about 40 bytes per parameter, LANS about 48, against 28
 * for Adam. Reductions add float partial sums over spans into doubles, and the per-element
 * divisions are cut to one (reciprocals of the bias corrections), so the passes stay
 * memory-bound. Each loop is one always-inlined function; its specialisations for each kind
 * of weight and gradient are plain functions, run by forwards(), backwards() or shares()
 * (loops.h), or by run_blocks() over compact moments (blocks.h).
 *
 * For bfloat16 parameters with float32 master weights, the *_bf16g specialisations read the
 * bfloat16 gradient directly. The master is either a float32 tensor (phase 2 then also writes the rounded
 * bfloat16 parameter, round to nearest even as torch's conversion) or split (kind bit 1): the
 * bfloat16 parameter holds its upper half and w16[] its lower 16 bits, read and written in place
 * (see split_join), 4 bytes per weight instead of 4 + 2: LAMB then moves about 38 bytes per
 * parameter, LANS about 42.
 *
 * Moments stored in bfloat16 or 8 bits (scaleopt._compact) are read and written in place by the
 * same passes, block by block (blocks.h): no float32 copy of a moment is made, and LAMB
 * with int8 moments moves about 26 bytes per parameter. On CPUs with AVX-512 those loops run
 * 16 lanes at a time (avx512.h).
 *
 * The module is also a (empty) Python extension so that setuptools builds it like one; it uses
 * only the stable ABI of Python 3.10, so one build serves every CPython from 3.10 on.
 *
 * One translation unit, in parts that each use only what the parts before them define:
 *   base.h     the platform, the structs of the calls, bfloat16 and split-master conversions;
 *   compact.h  the compact moments' format, element by element and block by block;
 *   loops.h    how the float32 passes run (spans, chunks backwards, shares), the weights'
 *              loads and stores, the arithmetic the algorithms share;
 *   blocks.h   how the compact passes run (a tensor's blocks, the threads, the portable loop);
 *   avx512.h   the same with AVX-512 (codes, lanes, the loop), and the buffer LAMB and LANS
 *              keep updates in between their passes;
 *   lamb.h, lans.h, adam.h   each algorithm: its float32 passes, then its portable and AVX-512
 *              compact loops, then the function that runs each over a tensor;
 * then here, the dispatch (each tensor's half steps: which pass runs it, and the trust ratios
 * between them), then the entry points that _native.py binds (but struct_layout, next to the
 * structs in base.h; compact_simd, the choice of loops, in avx512.h; sum_squares, LANS's first
 * pass, in lans.h), then the module.
 */
#include "base.h"
#include "compact.h"
#include "loops.h"
#include "blocks.h"
#include "avx512.h"
#include "lamb.h"
#include "lans.h"
#include "adam.h"

/* ---------------------------------------------------------------------------------------- */
/* The dispatch: one tensor's half steps, LAMB's and LANS's sums and apply                  */
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

/* keep: where the AVX-512 loops may keep updates between the two passes (keep_take), or NULL. */
static void lamb_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double *sums,
                      const Keep *keep) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 1, cfg, &bc1, &bc2_sqrt);
    const float decay = (float)(1.0 - x->lr * x->wd);
    if (x->form != FORM_FLOAT32) {
        lamb_compact_sums(x, cfg, bc1, bc2_sqrt, decay, sums, keep);
        return;
    }
    lamb_phase1(x, cfg, bc1, bc2_sqrt, decay, sums);
}

static void lamb_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg, const double *sums,
                       const Keep *keep) {
    double bc1, bc2_sqrt;
    bias_corrections(x->step, 0, cfg, &bc1, &bc2_sqrt);
    const float decay = (float)(1.0 - x->lr * x->wd);
    const double ratio = x->adapt ? trust_ratio(sums[0], sums[1], cfg) : 1.0;
    if (x->form != FORM_FLOAT32) {
        lamb_compact_apply(x, cfg, bc1, bc2_sqrt, decay, (float)x->lr, (float)ratio, keep);
        return;
    }
    lamb_phase2(x, cfg, bc1, bc2_sqrt, decay, (float)x->lr, (float)ratio);
}

/* LANS's gradient norm: x->gsq when given (>= 0: already computed by the same sum_squares, for
 * the clipping norms, so that pass is not run again), else one pass over the gradient. */
static double grad_sum_squares(const LayerwiseTensor *x, int nthreads) {
    if (x->gsq >= 0.0) return x->gsq;
    return (x->kind & KIND_BF16_GRAD) ? sum_squares_bf16((const uint16_t *)x->g, x->n, nthreads)
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
    if (x->form != FORM_FLOAT32) {
        lans_compact_sums(x, cfg, bc1, bc2_sqrt, ginv, sums, keep);
        return;
    }
    lans_phase1(x, cfg, bc1, bc2_sqrt, ginv, sums);
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
    if (x->form != FORM_FLOAT32) {
        lans_compact_apply(x, cfg, bc1, bc2_sqrt, ginv, (float)lr_r, (float)lr_c, (float)ratio_r,
                           (float)ratio_c, keep);
        return;
    }
    lans_phase2(x, cfg, bc1, bc2_sqrt, ginv, (float)lr_r, (float)lr_c, (float)ratio_r,
                (float)ratio_c);
}

/* ---------------------------------------------------------------------------------------- */
/* The entry points: LAMB and LANS over all tensors of a group in one call                  */
/* ---------------------------------------------------------------------------------------- */

/* Each multi-tensor update runs per tensor as sums (phase 1: the step counter advanced, the
 * moments updated, the sums the trust ratios need) and apply (phase 2: the weights). The *_multi
 * functions run both on one tensor after the other (the second pass finds the first one's data
 * in the caches); *_multi_sums and *_multi_apply run each over all tensors, so that the sums of
 * sharded tensors' local pieces can be totalled (one all-reduce) in between. */

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

/* ---------------------------------------------------------------------------------------- */
/* Adam over all tensors of a group in one call                                             */
/* ---------------------------------------------------------------------------------------- */

/* One Adam step on each of `count` tensors (see AdamTensor); step[t] is incremented. */
void adam_multi(const AdamTensor *ts, int64_t count, const AdamConfig *cfg) {
    for (int64_t t = 0; t < count; t++) {
        const AdamTensor *x = &ts[t];
        *x->step += 1.0f; /* the state's step counter (a float32 scalar tensor) */
        if (x->form != FORM_FLOAT32) {
            adam_compact(x, cfg);
            continue;
        }
        adam_step(x, cfg);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Non-finite gradients                                                                     */
/* ---------------------------------------------------------------------------------------- */

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
/* Spans of SELECT_SPAN elements are first tested as a whole (a vectorised compare and OR);
   only the rare span holding a candidate is scanned element by element, in order. */
enum { SELECT_SPAN = 64 };

TARGETS int64_t select_above(const float *v, int64_t n, float thr, int64_t *out, int64_t cap) {
    int64_t count = 0, i = 0;
    for (; i < n; i += SELECT_SPAN) {
        const int64_t end = i + SELECT_SPAN < n ? i + SELECT_SPAN : n;
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

/* ---- compact optimizer state: whole tensors (scaleopt._compact's conversions) ------------ */

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
    const int64_t blocks = (row_len + COMPACT_BLOCK - 1) / COMPACT_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * row_len >= 65536)
    for (int64_t b = 0; b < rows * blocks; b++) {
        int64_t len;
        const int64_t at = block_start(b, blocks, row_len, &len);
        encode_block(codes, scales, FORM_INT8, is_signed, b, at, len, x + at,
                     block_max(x + at, len), offset, (uint32_t)key);
    }
}

TARGETS void int8_decode(const void *codes, const float *scales, float *x, int64_t rows,
                         int64_t row_len, int32_t is_signed, int32_t nthreads) {
    const int64_t blocks = (row_len + COMPACT_BLOCK - 1) / COMPACT_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * row_len >= 65536)
    for (int64_t b = 0; b < rows * blocks; b++) {
        int64_t len;
        const int64_t at = block_start(b, blocks, row_len, &len);
        decode_block(codes, scales, FORM_INT8, is_signed, b, at, len, x + at);
    }
}

TARGETS void bf16_round_stochastic(const float *x, uint16_t *out, int64_t n, int64_t offset,
                                   int64_t key, int32_t nthreads) {
#pragma omp parallel for simd num_threads(nthreads) schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) out[i] = round_stochastic(x[i], (uint32_t)(offset + i) + (uint32_t)key);
}

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "Fused CPU kernels (called through ctypes).", -1,
                                            NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
