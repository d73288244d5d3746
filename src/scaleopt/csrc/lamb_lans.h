/* LAMB's and LANS's passes over float32 moments.
 * Part of kernels.c, which includes the parts in order as one translation unit.
 *
 * Each pass is one loop, an always-inlined function whose last arguments say what kind of
 * weight and gradient it reads (constants): a specialisation per kind (a TARGETS function
 * that calls it with them, cloned for the CPU's vector units) is what forwards() or
 * backwards() runs over the tensor's spans or chunks. The scalars a loop reads come in a struct that
 * it copies first, so that its stores to the moments cannot be taken to change them. */

/* A first pass's specialisations are indexed by the kind's bits (KIND_SPLIT: a split master,
 * KIND_BF16_GRAD: a bfloat16 gradient), and 4 more with element-wise clipping. */

/* ---------------------------------------------------------------------------------------- */
/* LAMB                                                                                       */
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
    const float beta1 = (float)cfg->beta1, beta2 = (float)cfg->beta2;
    Lamb1 a = {x->w, x->g, x->w16, x->m, x->v, x->gmul, cfg->clip_lo, cfg->clip_hi, beta2,
               1.0f - beta1, 1.0f - beta2, 1.0f / (float)bc1, 1.0f / (float)bc2_sqrt, cfg->eps};
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
/* LANS                                                                                       */
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
    const float beta1 = (float)cfg->beta1, beta2 = (float)cfg->beta2;
    const Lans1 a = {x->w, x->g, x->w16, x->m, x->v, ginv, cfg->clip_lo, cfg->clip_hi, beta2,
                     1.0f - beta1, 1.0f - beta2, 1.0f / (float)bc1, 1.0f / (float)bc2_sqrt,
                     cfg->eps, (float)x->wd};
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
