/* The compact loops with AVX-512, 16 lanes at a time (chosen at run time).
 * Part of kernels.c, which includes the parts in order as one translation unit. */

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

/* The AVX-512 loop of which (LAMB_SUMS, ...) where they run, else the portable one. */
static BlockLoop compact_loop(int which) {
    static const BlockLoop V16_LOOPS[] = {lamb_sums_blocks, lamb_apply_blocks, lans_sums_blocks,
                                          lans_apply_blocks, adam_blocks, adam_blocks,
                                          adam_blocks, adam_blocks};
    return v16_on() ? V16_LOOPS[which] : PORTABLE[which];
}
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
static BlockLoop compact_loop(int which) { return PORTABLE[which]; }
#endif

