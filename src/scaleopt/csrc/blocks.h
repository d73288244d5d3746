/* Compact moments (bfloat16 or int8) block by block: where a loop reads a tensor, the blocks it
 * covers, the threads that run them, and the portable loop over a thread's blocks that each
 * algorithm's file (lamb.h, lans.h, adam.h) fills in with its arithmetic.
 * Part of kernels.c, which includes the parts in order as one translation unit. */

/* ---------------------------------------------------------------------------------------- */
/* Compact moments, block by block                                                          */
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

/* A tensor's stored moments, with the keys of their bfloat16 rounding at this step. */
static Stored stored_of(void *m, void *v, float *m_scale, float *v_scale, int form,
                        int64_t offset, float step) {
    return (Stored){m, v, m_scale, v_scale, form, offset,
                    rounding_key(step, FORMAT_SALT_EXP_AVG),
                    rounding_key(step, FORMAT_SALT_EXP_AVG_SQ)};
}

INLINE void stage_w(const Staging *s, int64_t at, int64_t len, float *wb) {
    const uint16_t *hi = (const uint16_t *)s->w + at, *lo = s->lo + at;
    for (int64_t i = 0; i < len; i++) wb[i] = split_join(hi[i], lo[i]);
}

INLINE void stage_g(const Staging *s, int64_t at, int64_t len, float *gb) {
    const uint16_t *g = (const uint16_t *)s->g + at;
    for (int64_t i = 0; i < len; i++) gb[i] = bf16_to_f32(g[i]);
}

/* The new weights of a block, from wb: a split master's two halves (split != 0, w16 the lower
 * ones), or float32 rounded into the bfloat16 w16[] as well. */
INLINE void unstage_w(void *w, uint16_t *w16, int split, int64_t at, int64_t len,
                      const float *wb) {
    if (split) {
        uint16_t *hi = (uint16_t *)w + at, *lo = w16 + at;
        for (int64_t i = 0; i < len; i++) hi[i] = split_high(wb[i]), lo[i] = split_low(wb[i]);
        return;
    }
    float *p = (float *)w + at;
    for (int64_t i = 0; i < len; i++) p[i] = wb[i], w16[at + i] = f32_to_bf16(wb[i]);
}

/* A tensor's staging from its fields (kind, w16 as in the structs). */
static Staging staging(const void *w, const uint16_t *w16, const void *g, int32_t kind,
                       float wmul, float gmul, float glo, float ghi) {
    return (Staging){w, (kind & KIND_SPLIT) ? w16 : NULL, g, kind & KIND_BF16_GRAD, wmul, gmul, glo, ghi};
}

static Staging staging_of(const LayerwiseTensor *x, const LayerwiseConfig *cfg, float wmul,
                          float gmul) {
    return staging(x->w, x->w16, x->g, x->kind, wmul, gmul,
                   cfg->clip ? cfg->clip_lo : -INFINITY, cfg->clip ? cfg->clip_hi : INFINITY);
}

/* The most floats of the buffer where LAMB and LANS keep updates between their passes
 * (keep_take): 8 MiB, about what a core's share of the last-level cache holds along with the
 * weights and gradients of the blocks it covers. */
enum { KEEP_CAP = 1 << 21 };

/* That buffer, as a step holds it: size floats at at. */
typedef struct {
    float *at;
    int64_t size;
} Keep;

/* What the loops over a compact tensor's blocks read: its operands and the update's scalars
 * (those a loop does not use are 0). Each thread works on a copy. */
typedef struct {
    Staging s;
    Stored st;
    void *w;       /* the tensor's weights (written) */
    uint16_t *w16; /* as LayerwiseTensor */
    int split, in_place, moved, nesterov;
    int64_t per_row, row_len;
    float one_m_b1, one_m_b2, beta1, beta2, eps, inv_bc1, inv_bc2_sqrt;
    float wd_g, wd_u, wd;                 /* LAMB's decay into g or u; LANS's and Adam's */
    float lr, ratio, lr_r, lr_c, ratio_r, ratio_c; /* LAMB's and LANS's second pass */
    float decay, step_size, bc2_sqrt;     /* Adam */
    float *keep;        /* the updates of blocks keep_block.. (from element keep_from) */
    int64_t keep_block, keep_from, keep_half; /* LANS: its second numbers from keep_half on */
} Blocks;

static Blocks blocks_of(void *w, uint16_t *w16, int kind, int64_t row_len, Staging s,
                        Stored st) {
    Blocks c;
    memset(&c, 0, sizeof c);
    c.s = s;
    c.st = st;
    c.w = w;
    c.w16 = w16;
    c.split = store_form(kind, w16) == STORE_SPLIT;
    c.in_place = store_form(kind, w16) == STORE_F32;
    c.row_len = row_len;
    c.per_row = (row_len + COMPACT_BLOCK - 1) / COMPACT_BLOCK;
    c.keep_block = INT64_MAX; /* none kept */
    return c;
}

/* A loop over blocks [first, last) of a tensor, adding its sums (up to 4) to sums. */
typedef void (*BlockLoop)(const Blocks *c, int64_t first, int64_t last, double *sums);

/* loop over a tensor's n elements in blocks, the threads taking spans of BLOCK_SPAN blocks in
 * equal shares in order; its sums (count of them) each span's in a slot of its own, added up
 * in order (Slots, loops.h: the same whatever the thread count). */
enum { BLOCK_SPAN = SUM_SPAN / COMPACT_BLOCK };
static void run_blocks(BlockLoop loop, const Blocks *c, int64_t n, int nthreads, double *sums,
                       int count) {
    const int64_t total = c->row_len > 0 ? n / c->row_len * c->per_row : 0;
    const int64_t spans = (total + BLOCK_SPAN - 1) / BLOCK_SPAN;
    Slots s;
    if (nthreads < 1) nthreads = 1;
    nthreads = slots_open(&s, count ? spans : 0, count ? count : 1, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 32768)
    for (int64_t j = 0; j < spans; j++) {
        double b[4] = {0.0, 0.0, 0.0, 0.0};
        const int64_t first = j * BLOCK_SPAN, last = total - first < BLOCK_SPAN ? total : first + BLOCK_SPAN;
        if (!count) {
            loop(c, first, last, b);
            continue;
        }
        loop(c, first, last, slot_of(&s, j, b));
        slot_done(&s, b);
    }
    double out[4];
    slots_close(&s, out);
    for (int i = 0; i < count; i++) sums[i] = out[i];
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

/* A LAMB or LANS tensor's Blocks, with the moments' scalars as lamb_phase1 and lans_phase1
 * compute them, its weights taken times wmul and its gradient times gmul. */
static Blocks layerwise_blocks(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                               double bc1, double bc2_sqrt, float wmul, float gmul) {
    Blocks c = blocks_of(x->w, x->w16, x->kind, x->row_len, staging_of(x, cfg, wmul, gmul),
                         stored_of(x->m, x->v, x->m_scale, x->v_scale, x->form, x->offset,
                                   *x->step));
    c.beta2 = (float)cfg->beta2, c.one_m_b1 = (float)(1.0 - cfg->beta1);
    c.one_m_b2 = (float)(1.0 - cfg->beta2), c.eps = cfg->eps;
    c.inv_bc1 = 1.0f / (float)bc1, c.inv_bc2_sqrt = 1.0f / (float)bc2_sqrt;
    return c;
}

/* A block's inputs, as the loops read them: block b (elements at .. at + len), its weights
 * (*wp) and gradient (*gp), staged into wb, gb where not float32, its moments decoded into
 * mb, vb. Returns where the loop writes the new weights: in place, or wb for block_outputs. */
INLINE float *block_inputs(const Blocks *c, int64_t b, int64_t at, int64_t len,
                           const float **wp, const float **gp, float *wb, float *gb,
                           float *mb, float *vb) {
    *wp = (const float *)c->s.w + at, *gp = (const float *)c->s.g + at;
    if (c->s.lo) stage_w(&c->s, at, len, wb), *wp = wb;
    if (c->s.g_bf16) stage_g(&c->s, at, len, gb), *gp = gb;
    decode_block(c->st.m, c->st.m_scale, c->st.form, 1, b, at, len, mb);
    decode_block(c->st.v, c->st.v_scale, c->st.form, 0, b, at, len, vb);
    return c->in_place ? (float *)c->w + at : wb;
}

/* After a second pass's loop, which put the new weights in wb (where not in place), the new
 * moments in mb, vb and their largest magnitudes in am, av: the weights and moments stored. */
INLINE void block_outputs(const Blocks *c, int64_t b, int64_t at, int64_t len,
                          const float *wb, const float *mb, const float *vb, float am,
                          float av) {
    if (!c->in_place) unstage_w(c->w, c->w16, c->split, at, len, wb);
    encode_block(c->st.m, c->st.m_scale, c->st.form, 1, b, at, len, mb, am, c->st.offset,
                 c->st.m_key);
    encode_block(c->st.v, c->st.v_scale, c->st.form, 0, b, at, len, vb, av, c->st.offset,
                 c->st.v_key);
}

/* One element's new moments mi, vi from the stored m0, v0 and its gradient g (LAMB's with
 * its L2 decay, LANS's normalised and clamped, Adam's). */
INLINE void moments(const Blocks *c, float g, float m0, float v0, float *mi, float *vi) {
    new_moments(g, m0, v0, c->one_m_b1, c->beta2, c->one_m_b2, mi, vi);
}

/* The new moments staged in a block's buffers mb, vb (encoded after the loop) and their
 * largest magnitudes taken into *am, *av. */
INLINE void stage_moments(float *mb, float *vb, int64_t i, float mi, float vi, float *am,
                          float *av) {
    mb[i] = mi;
    vb[i] = vi;
    *am = fabsf(mi) > *am ? fabsf(mi) : *am;
    *av = vi > *av ? vi : *av;
}

/* What a loop does with one block of len elements: the weights wp[i] (to be taken times
 * s.wmul), the gradient gp[i], the stored moments decoded into mb[i], vb[i]. A first pass adds
 * its sums to sums; a second writes the new weights to wo[i], stages the new moments in mb, vb
 * (stage_moments) and their largest magnitudes in *amax, *vmax. Each algorithm's file defines
 * its own; portable_blocks() inlines them. */
typedef void (*SumsBlock)(const Blocks *c, int64_t len, const float *wp, const float *gp,
                          const float *mb, const float *vb, double *sums);
typedef void (*ApplyBlock)(const Blocks *c, int64_t len, const float *wp, const float *gp,
                           float *wo, float *mb, float *vb, float *amax, float *vmax);

/* The portable loop over a thread's blocks [first, last): each block's inputs, then a first
 * pass's sums_block or (sums_block NULL) a second pass's apply_block on them, then, after a
 * second pass, its weights and moments stored. Both are constants where it is inlined (each
 * algorithm's *_portable functions), so that the call is inlined too. */
INLINE void portable_blocks(const Blocks *blocks, int64_t first, int64_t last, double *sums,
                            SumsBlock sums_block, ApplyBlock apply_block) {
    const Blocks c = *blocks;
    float wb[COMPACT_BLOCK], gb[COMPACT_BLOCK], mb[COMPACT_BLOCK], vb[COMPACT_BLOCK];
    for (int64_t b = first; b < last; b++) {
        int64_t len;
        const int64_t at = block_start(b, c.per_row, c.row_len, &len);
        const float *wp, *gp;
        float *wo = block_inputs(&c, b, at, len, &wp, &gp, wb, gb, mb, vb), am, av;
        if (sums_block) {
            sums_block(&c, len, wp, gp, mb, vb, sums);
            continue;
        }
        apply_block(&c, len, wp, gp, wo, mb, vb, &am, &av);
        block_outputs(&c, b, at, len, wb, mb, vb, am, av);
    }
}
