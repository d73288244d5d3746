/* How the passes run: spans for the reductions, threads' chunks backwards, where a
 * weight is read and written.
 * Part of kernels.c, which includes the parts in order as one translation unit. */

/* Reductions run over spans of SUM_SPAN elements: within a span the sums are float (vector
 * lanes, a few hundred terms each), and each span's sum is added to a double. That keeps the
 * inner loop in single precision, where converting every term to double would make these
 * memory-bound passes compute-bound, and the result within ~1e-6 relative of a double sum. */
enum { SUM_SPAN = 2048 };

/* A pass over elements [from, to) of one tensor: a specialisation of one of the loops below
 * for one kind of weight and gradient, called per span (forwards) or per chunk (backwards).
 * It adds what it sums (up to 4 values, in float within a span) to sums. */
typedef void (*Pass)(const void *args, int64_t from, int64_t to, double *sums);

/* Sums that do not depend on the thread count. A reduction's terms fall into spans that the
 * tensor alone fixes (SUM_SPAN elements; over compact moments, BLOCK_SPAN blocks), each span's
 * sums go to a slot of their own, and once the threads are done the slots are added up in
 * order: the same additions in the same order whatever the number of threads (one thread's).
 * A tensor's slots live on the stack up to STACK_SPANS spans, else in memory allocated for the
 * pass (8 bytes per sum per span: n / 64 bytes for LANS's four sums of a float32 tensor, 0.4%
 * of what the pass reads); where that fails, the pass runs on one thread, adding the spans'
 * sums in the same order as it goes. */
enum { STACK_SPANS = 64 };
typedef struct {
    double *at; /* spans * count doubles, span by span; NULL: one thread, into total */
    int64_t spans;
    int count;
    double total[4];
    double stack[4 * STACK_SPANS];
} Slots;

/* Slots for spans spans of count sums each, zeroed; the number of threads the pass may use. */
static int slots_open(Slots *s, int64_t spans, int count, int nthreads) {
    s->spans = spans;
    s->count = count;
    memset(s->total, 0, sizeof s->total);
    const size_t bytes = (size_t)(spans > 0 ? spans : 1) * (size_t)count * sizeof(double);
    s->at = spans <= STACK_SPANS ? s->stack : (double *)malloc(bytes);
    if (!s->at) return 1;
    memset(s->at, 0, bytes);
    return nthreads;
}

/* Where span j's sums go: its slot, or (one thread, no slots) a zeroed scratch that
 * slot_done adds to the total. */
static inline double *slot_of(Slots *s, int64_t j, double *scratch) {
    if (s->at) return s->at + j * s->count;
    for (int k = 0; k < s->count; k++) scratch[k] = 0.0;
    return scratch;
}
static inline void slot_done(Slots *s, const double *scratch) {
    if (!s->at)
        for (int k = 0; k < s->count; k++) s->total[k] += scratch[k];
}

/* The totals, out[0 .. count): the slots added up span by span; the slots freed. */
static void slots_close(Slots *s, double *out) {
    if (s->at) {
        for (int64_t j = 0; j < s->spans; j++)
            for (int k = 0; k < s->count; k++) s->total[k] += s->at[j * s->count + k];
        if (s->at != s->stack) free(s->at);
    }
    for (int k = 0; k < s->count; k++) out[k] = s->total[k];
}

/* Runs pass over spans of SUM_SPAN elements, forwards, the threads taking the spans in equal
 * shares in order; out[0 .. count) the totals of the spans' sums (Slots: the same whatever
 * the thread count). */
static void forwards(Pass pass, const void *args, int64_t n, int nthreads, double *out,
                     int count) {
    Slots s;
    const int64_t spans = (n + SUM_SPAN - 1) / SUM_SPAN;
    nthreads = slots_open(&s, spans, count, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 32768)
    for (int64_t j = 0; j < spans; j++) {
        double b[4];
        const int64_t span = j * SUM_SPAN;
        pass(args, span, n - span < SUM_SPAN ? n : span + SUM_SPAN, slot_of(&s, j, b));
        slot_done(&s, b);
    }
    slots_close(&s, out);
}

/* The passes over a tensor alternate direction (LAMB: phase 1 forwards, phase 2 backwards; LANS:
 * the gradient's norm backwards, phase 1 forwards, phase 2 backwards), so that each thread starts
 * a pass where it ended the one before, on data still in the caches. For a tensor somewhat larger
 * than the last-level cache that saves a good part of a pass's reads, where a pass in the same
 * direction would find none of its data left (the cache evicts the oldest lines first, which it
 * needs first). Backwards means chunk by chunk (up to CHUNK elements), downwards; each chunk
 * upwards, so the hardware prefetchers still see ascending streams. A thread's chunks are the
 * ones it covered in the forward pass, give or take one. */
enum { CHUNK = 131072 };
/* This thread's chunks [first, last) of *size elements: each thread gets an equal number of
 * chunks of at most CHUNK elements (multiples of SUM_SPAN), about n / threads elements in all. */
static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
static inline void thread_chunks(int64_t n, int64_t *size, int64_t *first, int64_t *last) {
    const int id = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t share = round_up((n + nt - 1) / nt, SUM_SPAN);
    if (share == 0) share = SUM_SPAN;
    const int64_t per_thread = (share + CHUNK - 1) / CHUNK;
    *size = round_up((share + per_thread - 1) / per_thread, SUM_SPAN);
    const int64_t chunks = (n + *size - 1) / *size;
    *first = chunks * id / nt;
    *last = chunks * (id + 1) / nt;
}

/* Runs pass over this thread's chunks (thread_chunks), the last first. Where out is not
 * NULL, *out is the total of what pass sums: each span of SUM_SPAN elements summed into a slot
 * of its own (chunks are whole spans), the slots added up in order (Slots: the same whatever
 * the thread count). */
static void backwards(Pass pass, const void *args, int64_t n, int nthreads, double *out) {
    Slots s;
    if (out) nthreads = slots_open(&s, (n + SUM_SPAN - 1) / SUM_SPAN, 1, nthreads);
#pragma omp parallel num_threads(nthreads) if (n >= 32768)
    {
        int64_t size, first, last;
        double none = 0.0, b[4];
        thread_chunks(n, &size, &first, &last);
        for (int64_t chunk = last - 1; chunk >= first; chunk--) {
            const int64_t from = chunk * size, to = n - from < size ? n : from + size;
            if (!out) {
                pass(args, from, to, &none);
                continue;
            }
            for (int64_t span = from; span < to; span += SUM_SPAN) {
                pass(args, span, to - span < SUM_SPAN ? to : span + SUM_SPAN,
                     slot_of(&s, span / SUM_SPAN, b));
                slot_done(&s, b);
            }
        }
    }
    if (out) slots_close(&s, out);
}

/* Runs pass once per thread, on an equal share of [0, n) each, in order: an element-wise pass. */
static void shares(Pass pass, const void *args, int64_t n, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (n >= 32768)
    {
        const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
        pass(args, n * id / nt, n * (id + 1) / nt, NULL);
    }
}

/* Where a pass reads a weight: float32 at w, or a split master (split != 0): the bfloat16
 * upper halves at w, the lower halves at w16. */
INLINE float weight_at(const void *w, const uint16_t *w16, int64_t i, int split) {
    return split ? split_join(((const uint16_t *)w)[i], w16[i]) : ((const float *)w)[i];
}

/* How a pass writes a weight (_format.h): float32 (STORE_F32), float32 and its bfloat16
 * rounding into w16 (STORE_F32_COPY: a bfloat16 parameter's float32 master), or a split master
 * (STORE_SPLIT); from a tensor's kind and its w16 (the structs' fields). */
static inline int store_form(int32_t kind, const uint16_t *w16) {
    return (kind & KIND_SPLIT) ? STORE_SPLIT : w16 ? STORE_F32_COPY : STORE_F32;
}
INLINE void weight_store(void *w, uint16_t *w16, int64_t i, float value, int store) {
    if (store == STORE_SPLIT) {
        ((uint16_t *)w)[i] = split_high(value);
        w16[i] = split_low(value);
    } else {
        ((float *)w)[i] = value;
        if (store == STORE_F32_COPY) w16[i] = f32_to_bf16(value);
    }
}

/* Each element's arithmetic that more than one algorithm uses (an algorithm's own is in its
 * file), one definition for the float32 and the compact loops. */

/* The new moments *mi, *vi from the gradient g and the old ones m0, v0 (LAMB, LANS, Adam). */
INLINE void new_moments(float g, float m0, float v0, float one_m_b1, float beta2,
                        float one_m_b2, float *mi, float *vi) {
    *mi = m0 + one_m_b1 * (g - m0);
    *vi = v0 * beta2 + one_m_b2 * g * g;
}

/* A gradient: float32, or bfloat16 (bf16 != 0). */
INLINE float grad_at(const void *g, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)g)[i]) : ((const float *)g)[i];
}
