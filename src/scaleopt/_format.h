/* The compact state's format: generated from scaleopt/_format.py by
 * `python -m scaleopt._format > src/scaleopt/_format.h`; do not edit. */
#ifndef SCALEOPT_FORMAT_H
#define SCALEOPT_FORMAT_H
#define FORMAT_MIN_NUMEL 4096
#define FORMAT_BLOCK 256
#define FORMAT_SIGNED_SCALE 0x1.f808000000000p+13f /* 16129 */
#define FORMAT_ROOT_OFFSET 0x1.e147ae0000000p-2f /* 0.47 */
#define FORMAT_UNSIGNED_SCALE 0x1.e000000000000p+0f /* 1.875 */
#define FORMAT_CODE_OFFSET 768u
#define FORMAT_CODE_SHIFT 20
#define FORMAT_CODE_LOW 0x1.0000000000000p-31f /* 2^-31 */
#define FORMAT_CODE_LOW_DOUBLE 0x1.0000000000000p-31
#define FORMAT_HASH_MUL 0x45D9F3Bu
#define FORMAT_STEP_MUL 0x9E3779B9u
#define FORMAT_SALT_MUL 0x632BE5ABu
#define FORMAT_SALT_EXP_AVG 1u
#define FORMAT_SALT_EXP_AVG_SQ 2u
#define FORMAT_SALT_MAX_EXP_AVG_SQ 3u
#define FORMAT_SALT_MOMENTUM_BUFFER 4u
enum { MODE_UPDATE = 0, MODE_DECOUPLED = 1, MODE_L2 = 2 };
enum { FORM_FLOAT32 = 0, FORM_BFLOAT16 = 1, FORM_INT8 = 2 };
enum { KIND_BF16_GRAD = 1, KIND_SPLIT = 2 };
enum { STORE_F32 = 0, STORE_F32_COPY = 1, STORE_SPLIT = 2 };
#endif
