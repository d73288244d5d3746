/* The compact moments' format, element by element and block by block (docs/state.md).
 * Part of kernels.c, which includes the parts in order as one translation unit. */

/* ---------------------------------------------------------------------------------------- */
/* Compact moments (scaleopt._compact), block by block                                       */
/* ---------------------------------------------------------------------------------------- */

/* Moments stored in bfloat16 (rounded stochastically) or int8 (blocks of COMPACT_BLOCK within a
 * row, a float32 scale each: signed codes on a square-root scale for m, unsigned 8-bit floats
 * rounded stochastically for v): the formats are described once, in docs/state.md, their
 * constants are _format.h's, and scaleopt._compact.quantize is the reference these loops store
 * the same bits as. The sum y + 2^-31 is taken in double here, where it is exact or rounds to
 * 2^-31 either way, so that no compiler fuses it with the product. */

#define COMPACT_BLOCK FORMAT_BLOCK
/* the moments' forms: FORM_FLOAT32, FORM_BFLOAT16, FORM_INT8 (_format.h) */
#define INLINE static inline __attribute__((always_inline))

/* Block b of rows of row_len elements (blocks per row): where it starts in the flat tensor,
 * and how many elements it holds. */
static inline int64_t block_start(int64_t b, int64_t blocks, int64_t row_len, int64_t *len) {
    const int64_t start = (b % blocks) * COMPACT_BLOCK;
    *len = row_len - start < COMPACT_BLOCK ? row_len - start : COMPACT_BLOCK;
    return (b / blocks) * row_len + start;
}

/* F(q) of an unsigned code (see above): the float32 of bits (q + 768) << 20. */
static inline float code_float(uint32_t q) {
    const uint32_t u = (q + FORMAT_CODE_OFFSET) << FORMAT_CODE_SHIFT;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A 32-bit hash of h (index + key). */
INLINE uint32_t hash32(uint32_t h) {
    h = ((h >> 16) ^ h) * FORMAT_HASH_MUL;
    h = ((h >> 16) ^ h) * FORMAT_HASH_MUL;
    return (h >> 16) ^ h;
}

/* 16 random bits, the lower half of the hash of h (index + key). */
INLINE uint32_t random16(uint32_t h) { return hash32(h) & 0xFFFFu; }

/* The random bits of the unsigned code at position i of a block whose first element's
 * global index plus the key is g: positions i and i + 16 of each 32 take the two halves of
 * one hash, of g + 16 (i div 32) + i mod 16 (an index inside the block: no two blocks and no
 * two pairs share one). */
INLINE uint32_t code_random16(uint32_t g, int64_t i) {
    const uint32_t h = hash32(g + (uint32_t)((i >> 5 << 4) | (i & 15)));
    return i & 16 ? h >> 16 : h & 0xFFFFu;
}

/* x rounded to bfloat16 up or down by the random bits of h (index + key). */
INLINE uint16_t round_stochastic(float x, uint32_t h) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)((bits + random16(h)) >> 16);
}

/* The key of the rounding hash at a step, for a moment (its salt): as _compact._key. */
static inline uint32_t rounding_key(float step, uint32_t salt) {
    return (uint32_t)(int64_t)step * FORMAT_STEP_MUL + salt * FORMAT_SALT_MUL;
}

/* Block b of a stored moment (len elements from element at) decoded into out[0..len). */
INLINE void decode_block(const void *codes, const float *scales, int form, int is_signed,
                         int64_t b, int64_t at, int64_t len, float *out) {
    if (form == FORM_BFLOAT16) {
        const uint16_t *in = (const uint16_t *)codes + at;
        for (int64_t i = 0; i < len; i++) out[i] = bf16_to_f32(in[i]);
    } else if (is_signed) {
        const float step = scales[b] / FORMAT_SIGNED_SCALE;
        const int8_t *in = (const int8_t *)codes + at;
        for (int64_t i = 0; i < len; i++) {
            const int32_t q = in[i];
            out[i] = (float)(q * (q < 0 ? -q : q)) * step;
        }
    } else {
        const float step = scales[b] / FORMAT_UNSIGNED_SCALE;
        const uint8_t *in = (const uint8_t *)codes + at;
        for (int64_t i = 0; i < len; i++) out[i] = (code_float(in[i]) - FORMAT_CODE_LOW) * step;
    }
}

/* The largest magnitude of in[0..len) (NaNs passed over). */
INLINE float block_max(const float *in, int64_t len) {
    float s = 0.0f;
#pragma omp simd reduction(max : s)
    for (int64_t i = 0; i < len; i++) {
        const float a = fabsf(in[i]);
        s = a > s ? a : s;
    }
    return s;
}

/* 127^2 / s and 1.875 / s: y = |x| times this (0 for an all-zero block). */
static inline float code_factor(int is_signed, float s) {
    return s > 0.0f ? (is_signed ? FORMAT_SIGNED_SCALE : FORMAT_UNSIGNED_SCALE) / s : 0.0f;
}

/* The signed code's magnitude of y >= 0 (see above), 0 for a NaN: trunc(sqrt(y) + 0.47) is it
 * or one less. */
static inline int32_t code_signed(float y) {
    const float t = sqrtf(y) + FORMAT_ROOT_OFFSET;
    const int32_t q = (int32_t)(y > 0.0f ? t : 0.0f);
    const float b = (float)q + 0.5f;
    return q + ((b * b <= y) & 1);
}

/* The unsigned code of y >= 0 with random bits r (see above); 0 for a NaN. */
static inline int32_t code_unsigned(float y, uint32_t r) {
    float z = (float)((double)y + FORMAT_CODE_LOW_DOUBLE);
    z = z >= FORMAT_CODE_LOW ? z : FORMAT_CODE_LOW;
    uint32_t bits;
    memcpy(&bits, &z, 4);
    const int32_t q = (int32_t)((bits + (r << 4)) >> FORMAT_CODE_SHIFT) - (int32_t)FORMAT_CODE_OFFSET;
    return q < 255 ? q : 255;
}

/* in[0..len) stored as block b of a moment (its elements from at): bfloat16 rounded with the
 * bits of global index offset + at + i, or codes with the scale s, the block's largest
 * magnitude (block_max). */
INLINE void encode_block(void *codes, float *scales, int form, int is_signed, int64_t b,
                         int64_t at, int64_t len, const float *in, float s, int64_t offset,
                         uint32_t key) {
    if (form == FORM_BFLOAT16) {
        uint16_t *out = (uint16_t *)codes + at;
        for (int64_t i = 0; i < len; i++)
            out[i] = round_stochastic(in[i], (uint32_t)(offset + at + i) + key);
        return;
    }
    scales[b] = s;
    const float c = code_factor(is_signed, s);
    if (is_signed) {
        int8_t *out = (int8_t *)codes + at;
        for (int64_t i = 0; i < len; i++) {
            const int32_t q = code_signed(fabsf(in[i]) * c);
            out[i] = (int8_t)(in[i] < 0.0f ? -q : q);
        }
        return;
    }
    uint8_t *out = (uint8_t *)codes + at;
    const uint32_t h = (uint32_t)(offset + at) + key;
    for (int64_t i = 0; i < len; i++)
        out[i] = (uint8_t)code_unsigned(fabsf(in[i]) * c, code_random16(h, i));
}

