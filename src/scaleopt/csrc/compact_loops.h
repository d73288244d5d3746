/* LAMB's and LANS's passes over compact moments, block by block (portable).
 * Part of kernels.c, which includes the parts in order as one translation unit. */

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

