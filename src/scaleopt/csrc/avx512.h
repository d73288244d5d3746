/* The compact loops' AVX-512 parts, 16 lanes at a time (chosen at run time): the format's
 * codes, a block's lanes, the loop over a thread's blocks that each algorithm's file fills in,
 * and the buffer where LAMB and LANS keep updates between their passes.
 * Part of kernels.c, which includes the parts in order as one translation unit. */

/* ---------------------------------------------------------------------------------------- */
/* Compact moments with AVX-512                                                               */
/* ---------------------------------------------------------------------------------------- */

/* The portable compact loops, 16 lanes at a time with AVX-512 intrinsics, on CPUs that have it
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
 * Weights and gradients are staged as in blocks.h; each block's new int8 moments wait in mb, vb
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

/* sqrt(x), x >= 0, as x times the estimate of 1/sqrt(x); and 1/d, the estimate. Each within
 * 2^-14 (relative) of the exact value: the update within 2^-13 of the exact one, far inside
 * the rounding of the stored moments (steps of 2^-8 in bfloat16, at least 1.6% in int8). */
V16_INLINE __m512 v16_sqrt(__m512 x) {
    return _mm512_mul_ps(x, _mm512_rsqrt14_ps(_mm512_max_ps(x, _mm512_set1_ps(FLT_MIN))));
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
        *v = _mm512_mul_ps(_mm512_sub_ps(fv, _mm512_set1_ps(FORMAT_CODE_LOW)), sv);
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
        _mm512_fmadd_ps(y, _mm512_rsqrt14_ps(y), _mm512_set1_ps(FORMAT_ROOT_OFFSET)),
        _mm512_set1_ps(FORMAT_ROOT_OFFSET));
    __m512 q = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 b = _mm512_add_ps(q, _mm512_set1_ps(0.5f));
    q = _mm512_mask_add_ps(q, _mm512_cmp_ps_mask(_mm512_mul_ps(b, b), y, _CMP_LE_OQ), q,
                           _mm512_set1_ps(1.0f));
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
    const __m512 low = _mm512_set1_ps(FORMAT_CODE_LOW);
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
V16_INLINE __m512 v16_load_part(const float *x, int64_t n, int t) {
    return _mm512_maskz_loadu_ps(v16_mask(16 * t, n > 16 * t ? n : 16 * t), x + 16 * t);
}

V16_INLINE __m512i v16_code(__m512 x, __m512 c, __m512i r16, int is_signed) {
    return is_signed ? v16_code_signed(x, c, r16) : v16_code_unsigned(x, c, r16);
}

V16_INLINE void v16_codes64(void *out, int64_t n, const float *x, __m512 c, int is_signed,
                            __m512i r0, __m512i r1, __m512i r2, __m512i r3) {
    const __m512i q0 = v16_code(v16_load_part(x, n, 0), c, r0, is_signed);
    const __m512i q1 = v16_code(v16_load_part(x, n, 1), c, r1, is_signed);
    const __m512i q2 = v16_code(v16_load_part(x, n, 2), c, r2, is_signed);
    const __m512i q3 = v16_code(v16_load_part(x, n, 3), c, r3, is_signed);
    const __m512i packed = is_signed ? _mm512_packs_epi16(_mm512_packs_epi32(q0, q1),
                                                          _mm512_packs_epi32(q2, q3))
                                     : _mm512_packus_epi16(_mm512_packus_epi32(q0, q1),
                                                           _mm512_packus_epi32(q2, q3));
    const __m512i bytes = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
    if (n == 64)
        _mm512_storeu_si512(out, bytes);
    else
        _mm512_mask_storeu_epi8(out, _bzhi_u64(~0ULL, (unsigned)n), bytes);
}

/* The random bits (times 16) of the low and high halves of hashes h. */
V16_INLINE __m512i v16_low16(__m512i h) {
    return _mm512_and_si512(_mm512_slli_epi32(h, 4), _mm512_set1_epi32(0xFFFF0));
}
V16_INLINE __m512i v16_high16(__m512i h) {
    return _mm512_and_si512(_mm512_srli_epi32(h, 12), _mm512_set1_epi32(0xFFFF0));
}

/* The codes of x[j..j + n) (n <= 64) from at. Unsigned ones take the random bits of
 * code_random16 (times 16): positions j .. j + 31 the halves of the hashes of g + j/2 + lane,
 * j + 32 .. j + 63 those of g + j/2 + 16 + lane. */
V16_INLINE void v16_codes_at(void *codes, int is_signed, int64_t at, int64_t j, int64_t n,
                             const float *x, __m512 c, int64_t offset, uint32_t key) {
    if (is_signed) {
        const __m512i none = _mm512_setzero_si512();
        v16_codes64((int8_t *)codes + at + j, n, x + j, c, 1, none, none, none, none);
        return;
    }
    const __m512i h0 = v16_hash32(offset + at + j / 2, key);
    const __m512i h1 = v16_hash32(offset + at + j / 2 + 16, key);
    v16_codes64((uint8_t *)codes + at + j, n, x + j, c, 0, v16_low16(h0), v16_high16(h0),
                v16_low16(h1), v16_high16(h1));
}

/* x[0..len) as block b of a moment's codes (from at), with the scale s (unsigned codes
 * rounded with the random bits of code_random16(offset + at + key, i)). A whole block runs
 * without masks. */
V16_INLINE void v16_encode(void *codes, float *scales, int is_signed, int64_t b, int64_t at,
                           int64_t len, const float *x, float s, int64_t offset, uint32_t key) {
    scales[b] = s;
    const __m512 c = _mm512_set1_ps(code_factor(is_signed, s));
    if (len == COMPACT_BLOCK) {
        for (int64_t j = 0; j < COMPACT_BLOCK; j += 64)
            v16_codes_at(codes, is_signed, at, j, 64, x, c, offset, key);
        return;
    }
    for (int64_t j = 0; j < len; j += 64)
        v16_codes_at(codes, is_signed, at, j, len - j < 64 ? len - j : 64, x, c, offset, key);
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

/* Whether a Blocks' weights are taken as they are and its gradient is not clipped. */
static int v16_plain(const Blocks *c) {
    return c->s.wmul == 1.0f && c->s.glo == -INFINITY && c->s.ghi == INFINITY;
}

/* A Blocks' scalars in every lane. */
typedef struct {
    __m512 wf, gm, glo, ghi, omb1, omb2, beta1, beta2, eps, ibc1, ibc2;
} V16Scalars;

V16_INLINE V16Scalars v16_scalars(const Blocks *c) {
    const V16Scalars v = {_mm512_set1_ps(c->s.wmul),     _mm512_set1_ps(c->s.gmul),
                          _mm512_set1_ps(c->s.glo),      _mm512_set1_ps(c->s.ghi),
                          _mm512_set1_ps(c->one_m_b1),   _mm512_set1_ps(c->one_m_b2),
                          _mm512_set1_ps(c->beta1),      _mm512_set1_ps(c->beta2),
                          _mm512_set1_ps(c->eps),        _mm512_set1_ps(c->inv_bc1),
                          _mm512_set1_ps(c->inv_bc2_sqrt)};
    return v;
}

/* One block as the AVX-512 loops read it: block b, elements at .. at + len; its weights wp
 * and gradient gp (staged where they are not float32), where the new weights go (wo), the
 * steps sm, sv of its int8 codes, and buffers for its new int8 moments (mb, vb). */
typedef struct {
    int64_t b, at, len;
    const float *wp, *gp;
    float *wo, *mb, *vb;
    __m512 sm, sv;
} V16Block;

/* Lanes j .. j + 15 of a block (mask k): w and the gradient gt as the portable loops take
 * them (wp * wf, clamp(gp * gm, glo, ghi)); plain (a constant) where wf is 1 and the bounds
 * are infinite, and these are the identity. */
V16_INLINE __m512 v16_w(const V16Scalars *v, const V16Block *k, int64_t j, __mmask16 mask,
                        int plain) {
    const __m512 w0 = _mm512_maskz_loadu_ps(mask, k->wp + j);
    return plain ? w0 : _mm512_mul_ps(w0, v->wf);
}

V16_INLINE __m512 v16_gt(const V16Scalars *v, const V16Block *k, int64_t j, __mmask16 mask,
                         int plain) {
    const __m512 g0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, k->gp + j), v->gm);
    return plain ? g0 : _mm512_min_ps(v->ghi, _mm512_max_ps(v->glo, g0));
}

/* The moments' update from the gradient g with the operations the portable loops compile to
 * (so that both store the same moments); returns 1/(sqrt(v^) + eps). */
V16_INLINE __m512 v16_moments(const V16Scalars *v, __m512 g, __m512 m0, __m512 v0, __m512 *mi,
                              __m512 *vi) {
    *mi = _mm512_fmadd_ps(v->omb1, _mm512_sub_ps(g, m0), m0);
    *vi = _mm512_fmadd_ps(v0, v->beta2, _mm512_mul_ps(_mm512_mul_ps(v->omb2, g), g));
    return v16_recip(_mm512_fmadd_ps(v16_sqrt(*vi), v->ibc2, v->eps));
}

/* The new moments mi, vi staged: int8 ones in mb, vb with their largest magnitudes in am, av
 * (NaNs passed over), bfloat16 ones stored. */
V16_INLINE void v16_stage(const Blocks *c, const V16Block *k, int int8, int64_t j,
                          __mmask16 mask, __m512 mi, __m512 vi, __m512 *am, __m512 *av) {
    if (int8) {
        _mm512_storeu_ps(k->mb + j, mi);
        _mm512_storeu_ps(k->vb + j, vi);
        *am = _mm512_mask_max_ps(*am, mask, _mm512_abs_ps(mi), *am);
        *av = _mm512_mask_max_ps(*av, mask, vi, *av);
        return;
    }
    const int64_t at = k->at + j;
    v16_store_bf16((uint16_t *)c->st.m + at, mask, mi, c->st.offset + at, c->st.m_key);
    v16_store_bf16((uint16_t *)c->st.v + at, mask, vi, c->st.offset + at, c->st.v_key);
}

/* After a block's loop: its int8 moments, staged in mb, vb, stored. */
V16_INLINE void v16_store_moments(const Blocks *c, const V16Block *k, int int8, __m512 am,
                                  __m512 av) {
    if (int8)
        v16_encode_block(&c->st, k->b, k->at, k->len, k->mb, k->vb, _mm512_reduce_max_ps(am),
                         _mm512_reduce_max_ps(av));
}

/* After a second pass's loop: the new weights, where they were staged. */
V16_INLINE void v16_unstage(const Blocks *c, const V16Block *k) {
    if (!c->in_place) unstage_w(c->w, c->w16, c->split, k->at, k->len, k->wo);
}

/* What an AVX-512 loop does with one block (each algorithm's file defines its own, and
 * v16_blocks() inlines them): plain, int8 and len constants where known (len is the block's
 * length), kept: the block is one whose updates the first pass keeps for the second
 * (c->keep_block on: the end of the tensor, where the second pass starts). A first pass adds
 * its sums to sums. */
typedef void (*V16Loop)(const Blocks *c, const V16Scalars *v, const V16Block *k, int plain,
                        int int8, int64_t len, int kept, double *sums);

/* A thread's blocks [first, last): each block's inputs, then loop on it. A whole block of int8
 * codes with plain weights and gradients (the common case) runs a copy of the loop in which
 * all that is constant (no masks, no scaling of w, no clamp, one form); the others the general
 * one. Only LAMB's and LANS's passes keep (Adam's blocks are never from c->keep_block on). */
V16_INLINE void v16_blocks(const Blocks *blocks, int64_t first, int64_t last, double *sums,
                           V16Loop loop) {
    const Blocks c = *blocks;
    const V16Scalars v = v16_scalars(&c);
    float wb[COMPACT_BLOCK], gb[COMPACT_BLOCK], mb[COMPACT_BLOCK], vb[COMPACT_BLOCK];
    const int int8 = c.st.form == FORM_INT8, plain = v16_plain(&c);
    for (int64_t b = first; b < last; b++) {
        V16Block k = {b, 0, 0, NULL, NULL, NULL, mb, vb};
        k.at = block_start(b, c.per_row, c.row_len, &k.len);
        k.wp = (const float *)c.s.w + k.at, k.gp = (const float *)c.s.g + k.at;
        if (c.s.lo) stage_w(&c.s, k.at, k.len, wb), k.wp = wb;
        if (c.s.g_bf16) stage_g(&c.s, k.at, k.len, gb), k.gp = gb;
        k.wo = c.in_place ? (float *)c.w + k.at : wb;
        k.sm = _mm512_set1_ps(int8 ? c.st.m_scale[b] / FORMAT_SIGNED_SCALE : 0.0f);
        k.sv = _mm512_set1_ps(int8 ? c.st.v_scale[b] / FORMAT_UNSIGNED_SCALE : 0.0f);
        const int whole = int8 && k.len == COMPACT_BLOCK && plain;
        if (b >= c.keep_block) {
            if (whole)
                loop(&c, &v, &k, 1, 1, COMPACT_BLOCK, 1, sums);
            else
                loop(&c, &v, &k, 0, int8, k.len, 1, sums);
        } else if (whole) {
            loop(&c, &v, &k, 1, 1, COMPACT_BLOCK, 0, sums);
        } else {
            loop(&c, &v, &k, 0, int8, k.len, 0, sums);
        }
    }
}

/* Which loop runs a compact pass: the AVX-512 one where it runs, else the portable one. */
#define COMPACT_LOOP(portable, v16) (v16_on() ? (v16) : (portable))

/* The kept updates (v16_lamb_sums, v16_lans_sums): one buffer for the process, of up
 * to KEEP_CAP floats, held by one *_multi call at a time. It covers the last elements of each
 * tensor, as many as it holds (half as many for LANS, which keeps two numbers per element),
 * and is freed at the end of the call.
 * Only *_multi, which runs both passes of a tensor back to back, keeps; the sharded calls
 * (*_multi_sums, then *_multi_apply) compute the updates again. */
static float *keep_buffer;
static int64_t keep_floats;
static char keep_busy;

/* The buffer for the updates of the compact tensors of ts, floats per element: as large as
 * the largest needs, up to KEEP_CAP, made for the call and freed by keep_give, so that
 * nothing is held between steps (a transient of the step). NULL where nothing is compact,
 * where another call holds it, or where the AVX-512 loops do not run. */
static const Keep *keep_take(const LayerwiseTensor *ts, int64_t count, int64_t floats,
                             Keep *keep) {
    int64_t need = 0;
    for (int64_t t = 0; t < count; t++)
        if (ts[t].form != FORM_FLOAT32 && ts[t].n * floats > need) need = ts[t].n * floats;
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
    if (!keep) return;
    free(keep_buffer);
    keep_buffer = NULL;
    keep_floats = 0;
    __atomic_clear(&keep_busy, __ATOMIC_RELEASE);
}
#else
#define COMPACT_LOOP(portable, v16) (portable)
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
#endif
