/* Adam and AdamW, OffloadAdam's host step, in torch's order of operations: one tensor's
 * pass, on float32 moments and on compact ones (the portable loop, then the AVX-512 one).
 * Part of kernels.c, which includes the parts in order as one translation unit. */

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
 *  - float32 (adam_f32*): p[i]; the rounded weight also goes to w16[] (bfloat16) if not NULL.
 *  - split (adam_split*): a bfloat16 parameter and the low 16 bits of its float32 master.
 *    The master is stored exactly: its upper 16 bits are the parameter's bits, less one when
 *    the parameter was rounded up, i.e. when the low half is >= 0x8000. The parameter is the
 *    master rounded to nearest (ties away from zero). Per parameter that reads and writes 2+2
 *    bytes instead of 4 (master) + 2 (parameter, plus the read that a store to a line not in
 *    cache costs), with a handful of integer operations. */
typedef struct {
    void *w;
    uint16_t *w16;
    const void *g;
    float *m, *v;
    float step_size, beta1, one_m_b1, beta2, one_m_b2, bc2_sqrt, inv_bc2_sqrt, eps, wd_l2, decay,
        gmul;
    int nesterov;
} Adam;

/* The update's denominator. float32 weights: torch's exact sqrt(v)/bc2_sqrt + eps. Split
 * (bfloat16) weights, whose parameter is rounded anyway: sqrt(v) * (1/bc2_sqrt) + eps, one
 * division less per element (within an ulp of the division). */
INLINE float adam_denom(float vi, float bc2_sqrt, float inv_bc2_sqrt, float eps, int fast) {
    return fast ? sqrtf(vi) * inv_bc2_sqrt + eps : sqrtf(vi) / bc2_sqrt + eps;
}

INLINE void adam(const void *args, int64_t from, int64_t to, int store, int bf16) {
    const Adam a = *(const Adam *)args;
#pragma omp simd
    for (int64_t i = from; i < to; i++) {
        float w = weight_at(a.w, a.w16, i, store == STORE_SPLIT);
        float gi = grad_at(a.g, i, bf16) * a.gmul + a.wd_l2 * w;
        float mi, vi;
        new_moments(gi, a.m[i], a.v[i], a.one_m_b1, a.beta2, a.one_m_b2, &mi, &vi);
        a.m[i] = mi;
        a.v[i] = vi;
        float num = a.nesterov ? a.beta1 * mi + a.one_m_b1 * gi : mi;
        float den = adam_denom(vi, a.bc2_sqrt, a.inv_bc2_sqrt, a.eps, store == STORE_SPLIT);
        weight_store(a.w, a.w16, i, w * a.decay - a.step_size * (num / den), store);
    }
}

TARGETS static void adam_f32(const void *a, int64_t i, int64_t j, double *s) { (void)s, adam(a, i, j, STORE_F32, 0); }
TARGETS static void adam_f32_bf16g(const void *a, int64_t i, int64_t j, double *s) { (void)s, adam(a, i, j, STORE_F32, 1); }
TARGETS static void adam_f32_copy(const void *a, int64_t i, int64_t j, double *s) { (void)s, adam(a, i, j, STORE_F32_COPY, 0); }
TARGETS static void adam_f32_copy_bf16g(const void *a, int64_t i, int64_t j, double *s) { (void)s, adam(a, i, j, STORE_F32_COPY, 1); }
TARGETS static void adam_split(const void *a, int64_t i, int64_t j, double *s) { (void)s, adam(a, i, j, STORE_SPLIT, 0); }
TARGETS static void adam_split_bf16g(const void *a, int64_t i, int64_t j, double *s) { (void)s, adam(a, i, j, STORE_SPLIT, 1); }
static const Pass ADAM[3][2] = {{adam_f32, adam_f32_bf16g}, {adam_f32_copy, adam_f32_copy_bf16g},
                                {adam_split, adam_split_bf16g}};

/* Adam on compact moments (see blocks.h): one pass, block by block; split: the
 * weights are split masters (adam_denom's fast form); nesterov: Nesterov momentum. */
INLINE void adam_apply_block(const Blocks *c, int64_t len, const float *wp, const float *gp,
                             float *wo, float *mb, float *vb, float *amax, float *vmax,
                             int split, int nesterov) {
    float am = 0.0f, av = 0.0f;
#pragma omp simd reduction(max : am, av)
    for (int64_t i = 0; i < len; i++) {
        float w = wp[i];
        float gi = gp[i] * c->s.gmul + c->wd * w, mi, vi;
        moments(c, gi, mb[i], vb[i], &mi, &vi);
        float num = nesterov ? c->beta1 * mi + c->one_m_b1 * gi : mi;
        float den = adam_denom(vi, c->bc2_sqrt, c->inv_bc2_sqrt, c->eps, split);
        wo[i] = w * c->decay - c->step_size * (num / den);
        stage_moments(mb, vb, i, mi, vi, &am, &av);
    }
    *amax = am, *vmax = av;
}

/* The four specialisations of adam_apply_block as ApplyBlock (split, nesterov constants). */
INLINE void adam_block(const Blocks *c, int64_t len, const float *wp, const float *gp, float *wo, float *mb, float *vb, float *amax, float *vmax) { adam_apply_block(c, len, wp, gp, wo, mb, vb, amax, vmax, 0, 0); }
INLINE void adam_nesterov_block(const Blocks *c, int64_t len, const float *wp, const float *gp, float *wo, float *mb, float *vb, float *amax, float *vmax) { adam_apply_block(c, len, wp, gp, wo, mb, vb, amax, vmax, 0, 1); }
INLINE void adam_split_block(const Blocks *c, int64_t len, const float *wp, const float *gp, float *wo, float *mb, float *vb, float *amax, float *vmax) { adam_apply_block(c, len, wp, gp, wo, mb, vb, amax, vmax, 1, 0); }
INLINE void adam_split_nesterov_block(const Blocks *c, int64_t len, const float *wp, const float *gp, float *wo, float *mb, float *vb, float *amax, float *vmax) { adam_apply_block(c, len, wp, gp, wo, mb, vb, amax, vmax, 1, 1); }

TARGETS static void adam_apply_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, NULL, adam_block); }
TARGETS static void adam_apply_nesterov_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, NULL, adam_nesterov_block); }
TARGETS static void adam_apply_split_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, NULL, adam_split_block); }
TARGETS static void adam_apply_split_nesterov_portable(const Blocks *c, int64_t i, int64_t j, double *s) { portable_blocks(c, i, j, s, NULL, adam_split_nesterov_block); }
static const BlockLoop ADAM_PORTABLE[2][2] = {{adam_apply_portable, adam_apply_nesterov_portable},
                                              {adam_apply_split_portable, adam_apply_split_nesterov_portable}};

#ifdef HAVE_V16
/* Adam (adam_compact): w * decay - step_size * n / (sqrt(v) / bc2_sqrt + eps). The moments
 * with torch's operations, unfused (the intrinsics are vector arithmetic, which GCC would
 * otherwise fuse). */
V16_INLINE void v16_adam(const Blocks *c, const V16Scalars *v, const V16Block *k, int plain,
                         int int8, int64_t len, int kept, double *sums) {
    (void)kept, (void)sums;
    const __m512 vwd = _mm512_set1_ps(c->wd);
    const __m512 vdecay = _mm512_set1_ps(c->decay), vstep = _mm512_set1_ps(c->step_size);
    __m512 am = _mm512_setzero_ps(), av = am;
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mask = v16_mask(j, len);
        const __m512 w = v16_w(v, k, j, mask, plain), gt = v16_gt(v, k, j, mask, plain);
        __m512 m0, v0;
        v16_decode(&c->st, int8, k->at + j, mask, k->sm, k->sv, &m0, &v0);
        const __m512 gi = _mm512_add_ps(gt, _mm512_mul_ps(vwd, w));
        const __m512 mi = _mm512_add_ps(m0, _mm512_mul_ps(v->omb1, _mm512_sub_ps(gi, m0)));
        const __m512 vi = _mm512_add_ps(_mm512_mul_ps(v0, v->beta2),
                                        _mm512_mul_ps(_mm512_mul_ps(v->omb2, gi), gi));
        const __m512 dinv = v16_recip(_mm512_fmadd_ps(v16_sqrt(vi), v->ibc2, v->eps));
        const __m512 num =
            c->nesterov ? _mm512_fmadd_ps(v->beta1, mi, _mm512_mul_ps(v->omb1, gi)) : mi;
        _mm512_mask_storeu_ps(k->wo + j, mask, _mm512_fnmadd_ps(vstep, _mm512_mul_ps(num, dinv),
                                                                _mm512_mul_ps(w, vdecay)));
        v16_stage(c, k, int8, j, mask, mi, vi, &am, &av);
    }
    v16_unstage(c, k);
    v16_store_moments(c, k, int8, am, av);
}

V16 static void adam_v16(const Blocks *c, int64_t i, int64_t j, double *s) { v16_blocks(c, i, j, s, v16_adam); }
#endif

#pragma GCC pop_options

/* What runs the loops over a tensor, compiled as the rest (they do no arithmetic of the
 * update): a float32 tensor's pass, then a compact one's. */
static void adam_step(const AdamTensor *x, const AdamConfig *cfg) {
    const int store = store_form(x->kind, x->w16);
    const Adam a = {x->w, x->w16, x->g, x->m, x->v, x->step_size, cfg->beta1, cfg->one_m_b1,
                    cfg->beta2, cfg->one_m_b2, x->bc2_sqrt, 1.0f / x->bc2_sqrt, cfg->eps,
                    x->wd_l2, x->decay, x->gmul, cfg->nesterov};
    shares(ADAM[store][x->kind & KIND_BF16_GRAD], &a, x->n, cfg->nthreads);
}

/* An Adam tensor on compact moments: its weights as they are, its gradient times gmul, no
 * clipping. */
static void adam_compact(const AdamTensor *x, const AdamConfig *cfg) {
    const Staging s = staging(x->w, x->w16, x->g, x->kind, 1.0f, x->gmul, -INFINITY, INFINITY);
    Blocks c = blocks_of(x->w, x->w16, x->kind, x->row_len, s,
                         stored_of(x->m, x->v, x->m_scale, x->v_scale, x->form, x->offset,
                                   *x->step));
    c.one_m_b1 = cfg->one_m_b1, c.one_m_b2 = cfg->one_m_b2, c.beta1 = cfg->beta1;
    c.beta2 = cfg->beta2, c.eps = cfg->eps, c.inv_bc2_sqrt = 1.0f / x->bc2_sqrt;
    c.bc2_sqrt = x->bc2_sqrt, c.wd = x->wd_l2, c.decay = x->decay, c.step_size = x->step_size;
    c.nesterov = cfg->nesterov;
    run_blocks(COMPACT_LOOP(ADAM_PORTABLE[c.split][c.nesterov], adam_v16), &c, x->n, cfg->nthreads, NULL, 0);
}
