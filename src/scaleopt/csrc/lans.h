/* LANS: the gradient's norm, and one tensor's two passes, on float32 moments and on compact
 * ones.
 * Part of kernels.c, which includes the parts in order as one translation unit.
 *
 * Its float32 passes first (each pass one always-inlined loop whose last arguments say what
 * kind of weight and gradient it reads, as constants; a specialisation per kind, a TARGETS
 * function cloned for the CPU's vector units, is what forwards() or backwards() runs over the
 * tensor's spans or chunks; the scalars a loop reads come in a struct that it copies first, so
 * that its stores to the moments cannot be taken to change them), then its passes over
 * compact moments block by block: the portable loops, then the AVX-512 ones, then the two
 * chosen between (COMPACT_LOOP). */

/* LANS's 1 / (sqrt(v^) + eps). */
INLINE float lans_dinv(float vi, float inv_bc2_sqrt, float eps) {
    return 1.0f / (sqrtf(vi) * inv_bc2_sqrt + eps);
}

/* ---------------------------------------------------------------------------------------- */
/* LANS on float32 moments                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* The gradient's sum of squares, LANS's first pass: backwards, so that phase 1 (forwards) starts
 * on the gradient this pass read last. */
INLINE void squares(const void *x, int64_t from, int64_t to, double *sums, int bf16) {
    for (int64_t span = from; span < to; span += SUM_SPAN) {
        const int64_t end = to - span < SUM_SPAN ? to : span + SUM_SPAN;
        float b = 0.0f;
#pragma omp simd reduction(+ : b)
        for (int64_t i = span; i < end; i++) {
            float xi = grad_at(x, i, bf16);
            b += xi * xi;
        }
        *sums += b;
    }
}

TARGETS static void squares_f32(const void *x, int64_t i, int64_t j, double *s) { squares(x, i, j, s, 0); }
TARGETS static void squares_bf16(const void *x, int64_t i, int64_t j, double *s) { squares(x, i, j, s, 1); }

double sum_squares(const float *x, int64_t n, int nthreads) {
    double s;
    backwards(squares_f32, x, n, nthreads, &s);
    return s;
}

double sum_squares_bf16(const uint16_t *x, int64_t n, int nthreads) {
    double s;
    backwards(squares_bf16, x, n, nthreads, &s);
    return s;
}

/* Phase 1. gt = g * ginv, clamped to [glo, ghi] when clip != 0; moments;
 * d = sqrt(v)/bc2_sqrt + eps; r = (m/bc1)/d + wd*w, c = gt/d + wd*w.
 * Sums: w^2, r^2, c^2, r*c. */
typedef struct {
    const void *w, *g;
    const uint16_t *w16;
    float *m, *v;
    float ginv, glo, ghi, beta2, one_m_b1, one_m_b2, inv_bc1, inv_bc2_sqrt, eps, wd;
} Lans1;

INLINE void lans1(const void *args, int64_t from, int64_t to, double *sums, int split, int bf16,
                  int clip) {
    const Lans1 a = *(const Lans1 *)args;
    float bw = 0.0f, br = 0.0f, bc = 0.0f, brc = 0.0f;
#pragma omp simd reduction(+ : bw, br, bc, brc)
    for (int64_t i = from; i < to; i++) {
        float w = weight_at(a.w, a.w16, i, split);
        float gt = grad_at(a.g, i, bf16) * a.ginv;
        if (clip) gt = clampf(gt, a.glo, a.ghi);
        float mi, vi;
        new_moments(gt, a.m[i], a.v[i], a.one_m_b1, a.beta2, a.one_m_b2, &mi, &vi);
        a.m[i] = mi;
        a.v[i] = vi;
        float dinv = lans_dinv(vi, a.inv_bc2_sqrt, a.eps);
        float r = (mi * a.inv_bc1) * dinv + a.wd * w;
        float c = gt * dinv + a.wd * w;
        bw += w * w;
        br += r * r;
        bc += c * c;
        brc += r * c;
    }
    sums[0] += bw;
    sums[1] += br;
    sums[2] += bc;
    sums[3] += brc;
}

TARGETS static void lans1_f32(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 0, 0, 0); }
TARGETS static void lans1_f32_bf16g(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 0, 1, 0); }
TARGETS static void lans1_split(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 1, 0, 0); }
TARGETS static void lans1_split_bf16g(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 1, 1, 0); }
TARGETS static void lans1_f32_clip(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 0, 0, 1); }
TARGETS static void lans1_f32_bf16g_clip(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 0, 1, 1); }
TARGETS static void lans1_split_clip(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 1, 0, 1); }
TARGETS static void lans1_split_bf16g_clip(const void *a, int64_t i, int64_t j, double *s) { lans1(a, i, j, s, 1, 1, 1); }
static const Pass LANS1[8] = {lans1_f32, lans1_f32_bf16g, lans1_split, lans1_split_bf16g,
                              lans1_f32_clip, lans1_f32_bf16g_clip, lans1_split_clip, lans1_split_bf16g_clip};

static void lans_phase1(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                        double bc2_sqrt, float ginv, double *sums) {
    /* 1 - beta in double, rounded once: the reference's and the Triton kernels' numbers */
    const Lans1 a = {x->w, x->g, x->w16, x->m, x->v, ginv, cfg->clip_lo, cfg->clip_hi,
                     (float)cfg->beta2, (float)(1.0 - cfg->beta1), (float)(1.0 - cfg->beta2),
                     1.0f / (float)bc1, 1.0f / (float)bc2_sqrt, cfg->eps, (float)x->wd};
    forwards(LANS1[(x->kind & (KIND_SPLIT | KIND_BF16_GRAD)) | (cfg->clip ? 4 : 0)], &a, x->n, cfg->nthreads, sums, 4);
}

/* Phase 2: w1 = w - lr_r * (ratio_r * r); w2 = w1 - lr_c * (ratio_c * c), where c decays w1
 * when moved != 0 (MXNet's step()) and w otherwise: the rates of r and c, lr_r = lr*beta1 and
 * lr_c = lr*(1-beta1). */
typedef struct {
    void *w;
    const void *g;
    uint16_t *w16;
    const float *m, *v;
    float ginv, glo, ghi, inv_bc1, inv_bc2_sqrt, eps, wd, lr_r, lr_c, ratio_r, ratio_c;
    int moved;
} Lans2;

INLINE void lans2(const void *args, int64_t from, int64_t to, int store, int bf16, int clip) {
    const Lans2 a = *(const Lans2 *)args;
#pragma omp simd
    for (int64_t i = from; i < to; i++) {
        float w = weight_at(a.w, a.w16, i, store == STORE_SPLIT);
        float gt = grad_at(a.g, i, bf16) * a.ginv;
        if (clip) gt = clampf(gt, a.glo, a.ghi);
        float dinv = lans_dinv(a.v[i], a.inv_bc2_sqrt, a.eps);
        float r = (a.m[i] * a.inv_bc1) * dinv + a.wd * w;
        float w1 = w - a.lr_r * (a.ratio_r * r);
        float c = gt * dinv + a.wd * (a.moved ? w1 : w);
        weight_store(a.w, a.w16, i, w1 - a.lr_c * (a.ratio_c * c), store);
    }
}

TARGETS static void lans2_f32(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32, 0, 0); }
TARGETS static void lans2_f32_bf16g(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32, 1, 0); }
TARGETS static void lans2_f32_copy(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32_COPY, 0, 0); }
TARGETS static void lans2_f32_copy_bf16g(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32_COPY, 1, 0); }
TARGETS static void lans2_split(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_SPLIT, 0, 0); }
TARGETS static void lans2_split_bf16g(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_SPLIT, 1, 0); }
TARGETS static void lans2_f32_clip(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32, 0, 1); }
TARGETS static void lans2_f32_bf16g_clip(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32, 1, 1); }
TARGETS static void lans2_f32_copy_clip(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32_COPY, 0, 1); }
TARGETS static void lans2_f32_copy_bf16g_clip(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_F32_COPY, 1, 1); }
TARGETS static void lans2_split_clip(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_SPLIT, 0, 1); }
TARGETS static void lans2_split_bf16g_clip(const void *a, int64_t i, int64_t j, double *s) { (void)s, lans2(a, i, j, STORE_SPLIT, 1, 1); }
static const Pass LANS2[2][3][2] = {
    {{lans2_f32, lans2_f32_bf16g}, {lans2_f32_copy, lans2_f32_copy_bf16g}, {lans2_split, lans2_split_bf16g}},
    {{lans2_f32_clip, lans2_f32_bf16g_clip}, {lans2_f32_copy_clip, lans2_f32_copy_bf16g_clip}, {lans2_split_clip, lans2_split_bf16g_clip}},
};

static void lans_phase2(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                        double bc2_sqrt, float ginv, float lr_r, float lr_c, float ratio_r,
                        float ratio_c) {
    const Lans2 a = {x->w, x->g, x->w16, x->m, x->v, ginv, cfg->clip_lo, cfg->clip_hi,
                     1.0f / (float)bc1, 1.0f / (float)bc2_sqrt, cfg->eps, (float)x->wd, lr_r,
                     lr_c, ratio_r, ratio_c, cfg->moved};
    backwards(LANS2[cfg->clip != 0][store_form(x->kind, x->w16)][x->kind & KIND_BF16_GRAD], &a, x->n, cfg->nthreads, NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* LANS on compact moments                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* The Blocks of a LANS tensor, keeping two numbers per element. */
static Blocks lans_blocks(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                          double bc2_sqrt, float ginv, const Keep *keep) {
    Blocks c = layerwise_blocks(x, cfg, bc1, bc2_sqrt, 1.0f, ginv);
    c.wd = (float)x->wd, c.moved = cfg->moved;
    keep_range(&c, x->n, keep, 2);
    return c;
}

/* LANS's r of one element (weight w, gradient gt = its clamped normalised gradient), its new
 * moments in *mi, *vi and 1 / (sqrt(v^) + eps) in *dinv. */
INLINE float lans_update(const Blocks *c, float w, float gt, float m0, float v0, float *mi,
                         float *vi, float *dinv) {
    moments(c, gt, m0, v0, mi, vi);
    *dinv = lans_dinv(*vi, c->inv_bc2_sqrt, c->eps);
    return (*mi * c->inv_bc1) * *dinv + c->wd * w;
}

INLINE void lans_sums_block(const Blocks *c, int64_t len, const float *wp, const float *gp,
                            const float *mb, const float *vb, double *sums) {
    float bw = 0.0f, br = 0.0f, bc = 0.0f, brc = 0.0f;
#pragma omp simd reduction(+ : bw, br, bc, brc)
    for (int64_t i = 0; i < len; i++) {
        float w = wp[i] * c->s.wmul, gt = clampf(gp[i] * c->s.gmul, c->s.glo, c->s.ghi);
        float mi, vi, dinv;
        float r = lans_update(c, w, gt, mb[i], vb[i], &mi, &vi, &dinv);
        float cc = gt * dinv + c->wd * w;
        bw += w * w;
        br += r * r;
        bc += cc * cc;
        brc += r * cc;
    }
    sums[0] += bw;
    sums[1] += br;
    sums[2] += bc;
    sums[3] += brc;
}

INLINE void lans_apply_block(const Blocks *c, int64_t len, const float *wp, const float *gp,
                             float *wo, float *mb, float *vb, float *amax, float *vmax) {
    float am = 0.0f, av = 0.0f;
#pragma omp simd reduction(max : am, av)
    for (int64_t i = 0; i < len; i++) {
        float w = wp[i] * c->s.wmul, gt = clampf(gp[i] * c->s.gmul, c->s.glo, c->s.ghi);
        float mi, vi, dinv;
        float r = lans_update(c, w, gt, mb[i], vb[i], &mi, &vi, &dinv);
        float w1 = w - c->lr_r * (c->ratio_r * r);
        float cc = gt * dinv + c->wd * (c->moved ? w1 : w);
        wo[i] = w1 - c->lr_c * (c->ratio_c * cc);
        stage_moments(mb, vb, i, mi, vi, &am, &av);
    }
    *amax = am, *vmax = av;
}

TARGETS static void lans_sums_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, lans_sums_block, NULL); }
TARGETS static void lans_apply_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, NULL, lans_apply_block); }

#ifdef HAVE_V16
/* LANS's update r of lanes j .. j + 15 and 1/(sqrt(v^) + eps) (*dinv), and their new
 * moments. */
V16_INLINE __m512 v16_lans_r(const Blocks *c, const V16Scalars *v, const V16Block *k,
                             int64_t j, __mmask16 mask, int int8, __m512 w, __m512 gt,
                             __m512 *mi, __m512 *vi, __m512 *dinv) {
    __m512 m0, v0;
    v16_decode(&c->st, int8, k->at + j, mask, k->sm, k->sv, &m0, &v0);
    *dinv = v16_moments(v, gt, m0, v0, mi, vi);
    return _mm512_fmadd_ps(_mm512_mul_ps(*mi, v->ibc1), *dinv,
                           _mm512_mul_ps(_mm512_set1_ps(c->wd), w));
}

/* LANS's first pass; kept blocks also store their moments and keep r and 1/(sqrt(v^) + eps)
 * in c->keep (the first and second half), as v16_lamb_sums. */
V16_INLINE void v16_lans_sums(const Blocks *c, const V16Scalars *v, const V16Block *k,
                              int plain, int int8, int64_t len, int kept, double *sums) {
    const __m512 vwd = _mm512_set1_ps(c->wd);
    float *keep = kept ? c->keep + (k->at - c->keep_from) : NULL;
    __m512 bw = _mm512_setzero_ps(), br = bw, bc = bw, brc = bw, am = bw, av = bw;
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mask = v16_mask(j, len);
        const __m512 w = v16_w(v, k, j, mask, plain), gt = v16_gt(v, k, j, mask, plain);
        __m512 mi, vi, dinv;
        const __m512 r = v16_lans_r(c, v, k, j, mask, int8, w, gt, &mi, &vi, &dinv);
        const __m512 cc = _mm512_fmadd_ps(gt, dinv, _mm512_mul_ps(vwd, w));
        bw = _mm512_mask3_fmadd_ps(w, w, bw, mask);
        br = _mm512_mask3_fmadd_ps(r, r, br, mask);
        bc = _mm512_mask3_fmadd_ps(cc, cc, bc, mask);
        brc = _mm512_mask3_fmadd_ps(r, cc, brc, mask);
        if (kept) {
            _mm512_mask_storeu_ps(keep + j, mask, r);
            _mm512_mask_storeu_ps(keep + c->keep_half + j, mask, dinv);
            v16_stage(c, k, int8, j, mask, mi, vi, &am, &av);
        }
    }
    if (kept) v16_store_moments(c, k, int8, am, av);
    sums[0] += _mm512_reduce_add_ps(bw);
    sums[1] += _mm512_reduce_add_ps(br);
    sums[2] += _mm512_reduce_add_ps(bc);
    sums[3] += _mm512_reduce_add_ps(brc);
}

/* LANS's new weights of lanes j .. j + 15 from w, gt, r and dinv. */
V16_INLINE void v16_lans_weights(const Blocks *c, const V16Block *k, int64_t j, __mmask16 mask,
                                 __m512 w, __m512 gt, __m512 r, __m512 dinv) {
    const __m512 w1 = _mm512_fnmadd_ps(_mm512_set1_ps(c->lr_r),
                                       _mm512_mul_ps(_mm512_set1_ps(c->ratio_r), r), w);
    const __m512 cc = _mm512_fmadd_ps(gt, dinv,
                                      _mm512_mul_ps(_mm512_set1_ps(c->wd), c->moved ? w1 : w));
    _mm512_mask_storeu_ps(k->wo + j, mask,
                          _mm512_fnmadd_ps(_mm512_set1_ps(c->lr_c),
                                           _mm512_mul_ps(_mm512_set1_ps(c->ratio_c), cc), w1));
}

V16_INLINE void v16_lans_apply(const Blocks *c, const V16Scalars *v, const V16Block *k,
                               int plain, int int8, int64_t len, int kept,
                               double *sums) {
    (void)sums;
    if (kept) { /* r and dinv kept by the first pass; the moments are stored */
        const float *keep = c->keep + (k->at - c->keep_from);
        for (int64_t j = 0; j < k->len; j += 16) {
            const __mmask16 mask = v16_mask(j, k->len);
            const __m512 w = v16_w(v, k, j, mask, 0), gt = v16_gt(v, k, j, mask, 0);
            v16_lans_weights(c, k, j, mask, w, gt, _mm512_maskz_loadu_ps(mask, keep + j),
                             _mm512_maskz_loadu_ps(mask, keep + c->keep_half + j));
        }
        v16_unstage(c, k);
        return;
    }
    __m512 am = _mm512_setzero_ps(), av = am;
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mask = v16_mask(j, len);
        const __m512 w = v16_w(v, k, j, mask, plain), gt = v16_gt(v, k, j, mask, plain);
        __m512 mi, vi, dinv;
        const __m512 r = v16_lans_r(c, v, k, j, mask, int8, w, gt, &mi, &vi, &dinv);
        v16_lans_weights(c, k, j, mask, w, gt, r, dinv);
        v16_stage(c, k, int8, j, mask, mi, vi, &am, &av);
    }
    v16_unstage(c, k);
    v16_store_moments(c, k, int8, am, av);
}

V16 static void lans_sums_v16(const Blocks *c, int64_t i, int64_t j, double *s) { v16_blocks(c, i, j, s, v16_lans_sums); }
V16 static void lans_apply_v16(const Blocks *c, int64_t i, int64_t j, double *s) { v16_blocks(c, i, j, s, v16_lans_apply); }
#endif

static void lans_compact_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                              double bc2_sqrt, float ginv, double *out, const Keep *keep) {
    const Blocks c = lans_blocks(x, cfg, bc1, bc2_sqrt, ginv, keep);
    run_blocks(COMPACT_LOOP(lans_sums_portable, lans_sums_v16), &c, x->n, cfg->nthreads, out, 4);
}

static void lans_compact_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                               double bc1, double bc2_sqrt, float ginv, float lr_r, float lr_c,
                               float ratio_r, float ratio_c, const Keep *keep) {
    Blocks c = lans_blocks(x, cfg, bc1, bc2_sqrt, ginv, keep);
    c.lr_r = lr_r, c.lr_c = lr_c, c.ratio_r = ratio_r, c.ratio_c = ratio_c;
    run_blocks(COMPACT_LOOP(lans_apply_portable, lans_apply_v16), &c, x->n, cfg->nthreads, NULL, 0);
}
