/* LAMB: one tensor's two passes, on float32 moments and on compact ones.
 * Part of kernels.c, which includes the parts in order as one translation unit.
 *
 * Its float32 passes first (each pass one always-inlined loop whose last arguments say what
 * kind of weight and gradient it reads, as constants; a specialisation per kind, a TARGETS
 * function cloned for the CPU's vector units, is what forwards() or backwards() runs over the
 * tensor's spans or chunks; the scalars a loop reads come in a struct that it copies first, so
 * that its stores to the moments cannot be taken to change them), then its passes over
 * compact moments block by block: the portable loops, then the AVX-512 ones, then the two
 * chosen between (COMPACT_LOOP). */

/* A first pass's specialisations are indexed by the kind's bits (KIND_SPLIT: a split master,
 * KIND_BF16_GRAD: a bfloat16 gradient), and 4 more with element-wise clipping. */

/* LAMB's update u of weight w from the moments mi, vi (wd_u: the decay added to it). */
INLINE float lamb_u(float mi, float vi, float w, float inv_bc1, float inv_bc2_sqrt, float eps,
                    float wd_u) {
    return (mi * inv_bc1) / (sqrtf(vi) * inv_bc2_sqrt + eps) + wd_u * w;
}

/* ---------------------------------------------------------------------------------------- */
/* LAMB on float32 moments                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* Phase 1: m, v updated in place; the weight is only read; the gradient is g * gmul (its
 * scalars: sign, rescaling, clipping factors), clamped to [glo, ghi] when clip != 0. With
 * MODE_DECOUPLED the weight is taken as w * f, f the decay factor (phase 2 writes it so).
 * Sums: w^2 and u^2, u the full update (decay included). */
typedef struct {
    const void *w, *g;
    const uint16_t *w16;
    float *m, *v;
    float gmul, glo, ghi, beta2, one_m_b1, one_m_b2, inv_bc1, inv_bc2_sqrt, eps, f, wd_g, wd_u;
} Lamb1;

INLINE void lamb1(const void *args, int64_t from, int64_t to, double *sums, int split, int bf16,
                  int clip) {
    const Lamb1 a = *(const Lamb1 *)args;
    float bw = 0.0f, bu = 0.0f;
#pragma omp simd reduction(+ : bw, bu)
    for (int64_t i = from; i < to; i++) {
        float w = weight_at(a.w, a.w16, i, split) * a.f;
        float g = grad_at(a.g, i, bf16) * a.gmul;
        if (clip) g = clampf(g, a.glo, a.ghi);
        float gi = g + a.wd_g * w;
        float mi, vi;
        new_moments(gi, a.m[i], a.v[i], a.one_m_b1, a.beta2, a.one_m_b2, &mi, &vi);
        a.m[i] = mi;
        a.v[i] = vi;
        float u = lamb_u(mi, vi, w, a.inv_bc1, a.inv_bc2_sqrt, a.eps, a.wd_u);
        bw += w * w;
        bu += u * u;
    }
    sums[0] += bw;
    sums[1] += bu;
}

TARGETS static void lamb1_f32(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 0, 0, 0); }
TARGETS static void lamb1_f32_bf16g(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 0, 1, 0); }
TARGETS static void lamb1_split(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 1, 0, 0); }
TARGETS static void lamb1_split_bf16g(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 1, 1, 0); }
TARGETS static void lamb1_f32_clip(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 0, 0, 1); }
TARGETS static void lamb1_f32_bf16g_clip(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 0, 1, 1); }
TARGETS static void lamb1_split_clip(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 1, 0, 1); }
TARGETS static void lamb1_split_bf16g_clip(const void *a, int64_t i, int64_t j, double *s) { lamb1(a, i, j, s, 1, 1, 1); }
static const Pass LAMB1[8] = {lamb1_f32, lamb1_f32_bf16g, lamb1_split, lamb1_split_bf16g,
                              lamb1_f32_clip, lamb1_f32_bf16g_clip, lamb1_split_clip, lamb1_split_bf16g_clip};

/* f, wd_g, wd_u: the decay factor, and the decay added to the gradient and to the update, as
 * the mode says. */
static void lamb_decays(const LayerwiseTensor *x, const LayerwiseConfig *cfg, float decay,
                        float *f, float *wd_g, float *wd_u) {
    *f = cfg->mode == MODE_DECOUPLED ? decay : 1.0f;
    *wd_g = cfg->mode == MODE_L2 ? (float)x->wd : 0.0f;
    *wd_u = cfg->mode == MODE_UPDATE ? (float)x->wd : 0.0f;
}

static void lamb_phase1(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                        double bc2_sqrt, float decay, double *sums) {
    /* 1 - beta in double, rounded once: the reference's and the Triton kernels' numbers */
    Lamb1 a = {x->w, x->g, x->w16, x->m, x->v, x->gmul, cfg->clip_lo, cfg->clip_hi,
               (float)cfg->beta2, (float)(1.0 - cfg->beta1), (float)(1.0 - cfg->beta2),
               1.0f / (float)bc1, 1.0f / (float)bc2_sqrt, cfg->eps};
    lamb_decays(x, cfg, decay, &a.f, &a.wd_g, &a.wd_u);
    forwards(LAMB1[(x->kind & (KIND_SPLIT | KIND_BF16_GRAD)) | (cfg->clip ? 4 : 0)], &a, x->n, cfg->nthreads, sums, 2);
}

/* Phase 2: w = w*f - lr * (ratio * u). */
typedef struct {
    void *w;
    uint16_t *w16;
    const float *m, *v;
    float f, wd_u, inv_bc1, inv_bc2_sqrt, eps, lr, ratio;
} Lamb2;

INLINE void lamb2(const void *args, int64_t from, int64_t to, int store) {
    const Lamb2 a = *(const Lamb2 *)args;
#pragma omp simd
    for (int64_t i = from; i < to; i++) {
        float w = weight_at(a.w, a.w16, i, store == STORE_SPLIT) * a.f;
        float u = lamb_u(a.m[i], a.v[i], w, a.inv_bc1, a.inv_bc2_sqrt, a.eps, a.wd_u);
        weight_store(a.w, a.w16, i, w - a.lr * (a.ratio * u), store);
    }
}

TARGETS static void lamb2_f32(const void *a, int64_t i, int64_t j, double *s) { (void)s, lamb2(a, i, j, STORE_F32); }
TARGETS static void lamb2_f32_copy(const void *a, int64_t i, int64_t j, double *s) { (void)s, lamb2(a, i, j, STORE_F32_COPY); }
TARGETS static void lamb2_split(const void *a, int64_t i, int64_t j, double *s) { (void)s, lamb2(a, i, j, STORE_SPLIT); }
static const Pass LAMB2[3] = {lamb2_f32, lamb2_f32_copy, lamb2_split};

static void lamb_phase2(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                        double bc2_sqrt, float decay, float lr, float ratio) {
    float wd_g;
    Lamb2 a = {x->w, x->w16, x->m, x->v};
    lamb_decays(x, cfg, decay, &a.f, &wd_g, &a.wd_u);
    a.inv_bc1 = 1.0f / (float)bc1, a.inv_bc2_sqrt = 1.0f / (float)bc2_sqrt, a.eps = cfg->eps;
    a.lr = lr, a.ratio = ratio;
    backwards(LAMB2[store_form(x->kind, x->w16)], &a, x->n, cfg->nthreads, NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* LAMB on compact moments                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* The Blocks of a LAMB tensor, the updates it keeps in keep. */
static Blocks lamb_blocks(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                          double bc2_sqrt, float decay, const Keep *keep) {
    Blocks c = layerwise_blocks(x, cfg, bc1, bc2_sqrt,
                                cfg->mode == MODE_DECOUPLED ? decay : 1.0f, x->gmul);
    c.wd_g = cfg->mode == MODE_L2 ? (float)x->wd : 0.0f;
    c.wd_u = cfg->mode == MODE_UPDATE ? (float)x->wd : 0.0f;
    keep_range(&c, x->n, keep, 1);
    return c;
}

/* LAMB's update u of one element (weight w, gradient g), its new moments in *mi, *vi. */
INLINE float lamb_update(const Blocks *c, float w, float g, float m0, float v0, float *mi,
                         float *vi) {
    const float gi = clampf(g * c->s.gmul, c->s.glo, c->s.ghi) + c->wd_g * w;
    moments(c, gi, m0, v0, mi, vi);
    return lamb_u(*mi, *vi, w, c->inv_bc1, c->inv_bc2_sqrt, c->eps, c->wd_u);
}

/* What each loop does with a block of len elements: the weights wp[i] (times s.wmul), the
 * gradient gp[i], the stored moments mb[i], vb[i]. A first pass adds its sums to sums; a
 * second writes the new weights to wo[i] and stages the new moments (stage_moments). */
INLINE void lamb_sums_block(const Blocks *c, int64_t len, const float *wp, const float *gp,
                            const float *mb, const float *vb, double *sums) {
    float bw = 0.0f, bu = 0.0f;
#pragma omp simd reduction(+ : bw, bu)
    for (int64_t i = 0; i < len; i++) {
        float w = wp[i] * c->s.wmul, mi, vi;
        float u = lamb_update(c, w, gp[i], mb[i], vb[i], &mi, &vi);
        bw += w * w;
        bu += u * u;
    }
    sums[0] += bw;
    sums[1] += bu;
}

INLINE void lamb_apply_block(const Blocks *c, int64_t len, const float *wp, const float *gp,
                             float *wo, float *mb, float *vb, float *amax, float *vmax) {
    float am = 0.0f, av = 0.0f;
#pragma omp simd reduction(max : am, av)
    for (int64_t i = 0; i < len; i++) {
        float w = wp[i] * c->s.wmul, mi, vi;
        float u = lamb_update(c, w, gp[i], mb[i], vb[i], &mi, &vi);
        wo[i] = w - c->lr * (c->ratio * u);
        stage_moments(mb, vb, i, mi, vi, &am, &av);
    }
    *amax = am, *vmax = av;
}

TARGETS static void lamb_sums_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, lamb_sums_block, NULL); }
TARGETS static void lamb_apply_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, NULL, lamb_apply_block); }

#ifdef HAVE_V16
/* LAMB's update u of lanes j .. j + 15, and their new moments. */
V16_INLINE __m512 v16_lamb_u(const Blocks *c, const V16Scalars *v, const V16Block *k,
                             int64_t j, __mmask16 mask, int plain, int int8, __m512 w,
                             __m512 *mi, __m512 *vi) {
    const __m512 gi = _mm512_fmadd_ps(_mm512_set1_ps(c->wd_g), w, v16_gt(v, k, j, mask, plain));
    __m512 m0, v0;
    v16_decode(&c->st, int8, k->at + j, mask, k->sm, k->sv, &m0, &v0);
    const __m512 dinv = v16_moments(v, gi, m0, v0, mi, vi);
    return _mm512_fmadd_ps(_mm512_mul_ps(*mi, v->ibc1), dinv,
                           _mm512_mul_ps(_mm512_set1_ps(c->wd_u), w));
}

/* LAMB's first pass. Kept blocks also store their new moments and keep their updates in
 * c->keep, so that the second pass only writes their weights; the others only add up the
 * norms. */
V16_INLINE void v16_lamb_sums(const Blocks *c, const V16Scalars *v, const V16Block *k,
                              int plain, int int8, int64_t len, int kept, double *sums) {
    float *keep = kept ? c->keep + (k->at - c->keep_from) : NULL;
    __m512 bw = _mm512_setzero_ps(), bu = bw, am = bw, av = bw;
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mask = v16_mask(j, len);
        const __m512 w = v16_w(v, k, j, mask, plain);
        __m512 mi, vi;
        const __m512 u = v16_lamb_u(c, v, k, j, mask, plain, int8, w, &mi, &vi);
        bw = _mm512_mask3_fmadd_ps(w, w, bw, mask);
        bu = _mm512_mask3_fmadd_ps(u, u, bu, mask);
        if (kept) {
            _mm512_mask_storeu_ps(keep + j, mask, u);
            v16_stage(c, k, int8, j, mask, mi, vi, &am, &av);
        }
    }
    if (kept) v16_store_moments(c, k, int8, am, av);
    sums[0] += _mm512_reduce_add_ps(bw);
    sums[1] += _mm512_reduce_add_ps(bu);
}

V16_INLINE void v16_lamb_apply(const Blocks *c, const V16Scalars *v, const V16Block *k,
                               int plain, int int8, int64_t len, int kept,
                               double *sums) {
    (void)sums;
    const __m512 vlr = _mm512_set1_ps(c->lr), vratio = _mm512_set1_ps(c->ratio);
    if (kept) { /* the update kept by the first pass; the moments are stored */
        const float *keep = c->keep + (k->at - c->keep_from);
        for (int64_t j = 0; j < k->len; j += 16) {
            const __mmask16 mask = v16_mask(j, k->len);
            const __m512 w = v16_w(v, k, j, mask, 0);
            const __m512 u = _mm512_maskz_loadu_ps(mask, keep + j);
            _mm512_mask_storeu_ps(k->wo + j, mask,
                                  _mm512_fnmadd_ps(vlr, _mm512_mul_ps(vratio, u), w));
        }
        v16_unstage(c, k);
        return;
    }
    __m512 am = _mm512_setzero_ps(), av = am;
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mask = v16_mask(j, len);
        const __m512 w = v16_w(v, k, j, mask, plain);
        __m512 mi, vi;
        const __m512 u = v16_lamb_u(c, v, k, j, mask, plain, int8, w, &mi, &vi);
        _mm512_mask_storeu_ps(k->wo + j, mask, _mm512_fnmadd_ps(vlr, _mm512_mul_ps(vratio, u), w));
        v16_stage(c, k, int8, j, mask, mi, vi, &am, &av);
    }
    v16_unstage(c, k);
    v16_store_moments(c, k, int8, am, av);
}

V16 static void lamb_sums_v16(const Blocks *c, int64_t i, int64_t j, double *s) { v16_blocks(c, i, j, s, v16_lamb_sums); }
V16 static void lamb_apply_v16(const Blocks *c, int64_t i, int64_t j, double *s) { v16_blocks(c, i, j, s, v16_lamb_apply); }
#endif

static void lamb_compact_sums(const LayerwiseTensor *x, const LayerwiseConfig *cfg, double bc1,
                              double bc2_sqrt, float decay, double *out, const Keep *keep) {
    const Blocks c = lamb_blocks(x, cfg, bc1, bc2_sqrt, decay, keep);
    run_blocks(COMPACT_LOOP(lamb_sums_portable, lamb_sums_v16), &c, x->n, cfg->nthreads, out, 2);
}

static void lamb_compact_apply(const LayerwiseTensor *x, const LayerwiseConfig *cfg,
                               double bc1, double bc2_sqrt, float decay, float lr, float ratio,
                               const Keep *keep) {
    Blocks c = lamb_blocks(x, cfg, bc1, bc2_sqrt, decay, keep);
    c.lr = lr, c.ratio = ratio;
    run_blocks(COMPACT_LOOP(lamb_apply_portable, lamb_apply_v16), &c, x->n, cfg->nthreads, NULL, 0);
}
