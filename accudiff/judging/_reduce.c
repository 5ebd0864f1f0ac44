/* The statistics pass over a tensor, fused so that each element is read from memory once.
 *
 * numpy needs a dozen whole-array operations (and as many temporaries) to compute what accudiff reports
 * for a tensor; this kernel computes all of it, chunk by cache-sized chunk, in a few tight loops that the
 * compiler vectorizes, at a good share of memory bandwidth. It is the only compiled code in accudiff;
 * metrics.py defines every quantity, and the tests check the kernel against plain numpy. Beside it,
 * tolerance_needed: what a graph output's tolerance line needs (decisions.py), an element at a time in float64.
 *
 * reduce(ref, cand, rtol, base, rel_floor, quant, start, totals, sketch, scratch) -> None
 *   ref and cand: contiguous buffers of equal length, float32 and float32 or float16 (an FP16
 *   candidate is read through a table, a chunk at a time), or both float64; start: the index of
 *   ref[0] in the tensor; quant: None or (low, high, half_step); totals: writable float64 buffer of
 *   TOTALS accumulators (KERNEL_FIELDS in metrics.py), merged into; sketch: writable int64 buffer of
 *   SKETCH_BUCKETS counts, added to; scratch: writable buffer of SCRATCH_BYTES, the caller's (so that
 *   concurrent calls never share one).
 *
 * A chunk holding a NaN or an Inf (or one judged with atol = stol = 0, where a limit can be 0) goes through
 * a scalar path with the exact rules;
 * every other chunk through loops free of branches, which the compiler vectorizes (it is allowed to add a
 * block's terms in vector lanes: the last bits of a sum can differ between builds, never the counts,
 * minima or maxima). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SKETCH_BITS 5
#define SKETCH_LOW_EXPONENT (-40)
#define SKETCH_BUCKETS (80 << SKETCH_BITS)
#define SKETCH_SHIFT (23 - SKETCH_BITS)
#define SKETCH_OFFSET ((127 + SKETCH_LOW_EXPONENT) << SKETCH_BITS)
#define FP16_SMALLEST_NORMAL 6.103515625e-05
#define CHUNK (1 << 16)
#define SCRATCH_BYTES (2 * CHUNK * sizeof(float) + 4 * SKETCH_BUCKETS * sizeof(uint16_t))  /* buckets (in a float's room), converted halves, lanes */

#define BLOCK 256

/* x86-64 machines get AVX2 and AVX-512 (x86-64-v4, with GCC 12 or later) builds of the hot loops too,
 * picked at load time: their baseline, SSE2, works 4 floats at a time. From memory, on this project's
 * machine, an FP32 candidate took 2.14 ns an element with AVX2 and 1.51 with AVX-512; an FP16 one takes
 * 1.44 with AVX-512 (its halves are converted apart, eight at a time: fewer bytes to read). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 12
#define HOT_LOOP __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define HOT_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define HOT_LOOP
#endif

static float half_to_float_table[65536];

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: normalise it */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static void halves_to_floats_by_table(const uint16_t *restrict in, float *restrict out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) out[i] = half_to_float_table[in[i]];
}

/* With F16C, one instruction converts eight halves. Written with intrinsics: GCC 12 left a `_Float16`
 * loop scalar (a conversion per element, a quarter of the statistics' time on an FP16 candidate). */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx,f16c"))) static void halves_to_floats_f16c(const uint16_t *restrict in, float *restrict out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    halves_to_floats_by_table(in + i, out + i, n - i);
}

static void halves_to_floats(const uint16_t *restrict in, float *restrict out, Py_ssize_t n) {
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c"))
        halves_to_floats_f16c(in, out, n);
    else
        halves_to_floats_by_table(in, out, n);
}
#else
#define halves_to_floats halves_to_floats_by_table
#endif

typedef struct {
    double rtol, base, rel_floor, low, high, half_step;
    int has_quant;
} Params;

typedef struct {
    int64_t finite, outside, ref_nan, ref_inf, cand_nan, cand_inf, below_fp16_normal, flushed_to_zero, beyond_int8, below_int8_step;
    double abs_sum, rel_sum, ref_sq, err_sq, cand_sq, ref_cand, max_err, max_rel, tol_ratio, worst_distance, worst_ref, worst_cand;
    int poisoned;
    Py_ssize_t worst_index;
} Totals;

static void sketch_add(int64_t *sketch, float err) {
    uint32_t bits;
    memcpy(&bits, &err, sizeof bits);
    int64_t bucket = (int64_t)(bits >> SKETCH_SHIFT) - SKETCH_OFFSET;
    sketch[bucket < 0 ? 0 : (bucket >= SKETCH_BUCKETS ? SKETCH_BUCKETS - 1 : bucket)]++;
}

static void worst(Totals *t, Py_ssize_t i, double distance, double r, double c) {
    if (distance > t->worst_distance) {
        t->worst_distance = distance;
        t->worst_index = i;
        t->worst_ref = r;
        t->worst_cand = c;
    }
}

/* One element, any values: the exact rules (non-finite values are counted and judged, and left out of
 * the error statistics). Used for chunks that hold a NaN or an Inf. */
static void one_element(Totals *t, const Params *p, int64_t *sketch, Py_ssize_t i, double r, double c, int single) {
    if (!(isfinite(r) && isfinite(c))) {
        t->ref_nan += isnan(r) != 0;  /* isinf may return -1 for -Inf: count 1 */
        t->ref_inf += isinf(r) != 0;
        t->cand_nan += isnan(c) != 0;
        t->cand_inf += isinf(c) != 0;
        int agree = (isnan(r) && isnan(c)) || (isinf(r) && isinf(c) && (signbit(r) == signbit(c)));
        if (!agree) {
            t->outside++;
            t->poisoned = 1;
            worst(t, i, INFINITY, r, c);
        }
        return;
    }
    double e = fabs(c - r), a = fabs(r), l = a * p->rtol + p->base;
    if (single) {  /* float32 data: the same single-precision arithmetic as the vector loops */
        float ef = fabsf((float)c - (float)r), af = fabsf((float)r);
        float lf = af * (float)p->rtol + (float)p->base;
        e = ef; a = af; l = lf;
    }
    double ratio = l > 0 ? e / l : (e > 0 ? INFINITY : 0), rel = e / (a > p->rel_floor ? a : p->rel_floor);
    if (single) {
        ratio = l > 0 ? (float)e / (float)l : ratio;
        rel = (float)e / (float)(a > p->rel_floor ? a : p->rel_floor);
    }
    t->finite++;
    t->abs_sum += e; t->rel_sum += rel;
    t->ref_sq += r * r; t->err_sq += e * e; t->cand_sq += c * c; t->ref_cand += r * c;
    if (e > t->max_err) t->max_err = e;
    if (rel > t->max_rel) t->max_rel = rel;
    if (ratio > t->tol_ratio) t->tol_ratio = ratio;
    if (e > l) { t->outside++; worst(t, i, e, r, c); }
    t->below_fp16_normal += (a < FP16_SMALLEST_NORMAL) && (r != 0);
    t->flushed_to_zero += (c == 0) && (r != 0);
    if (p->has_quant) {
        t->beyond_int8 += (r < p->low) || (r > p->high);
        t->below_int8_step += (a < p->half_step) && (r != 0);
    }
    sketch_add(sketch, (float)e);
}

/* What the branch-free pass adds up: float64 sums (of float32 block sums), counts, and maxima kept as
 * the bits of non-negative floats (whose order as unsigned integers is their order as numbers: an
 * integer maximum vectorizes where a float one, with its NaN rules, does not). */
typedef struct {
    double abs_sum, rel_sum, ref_sq, err_sq, cand_sq, ref_cand;
    int64_t outside, below, flushed, beyond, below_step, non_finite;
    uint32_t max_err, max_rel, max_ratio, max_outside;  /* max_outside: the largest error of an element outside */
} Sums;

/* The branch-free loop over a float32 chunk with a positive `base` (so every limit is positive), which
 * the compiler vectorizes; it leaves each element's sketch bucket in `e` (computed in the vector lanes, so
 * that the sketch's own loop only counts). A NaN or an Inf anywhere
 * makes a block's sums non-finite (so can a product beyond 3e38 of finite values, rarely): then the
 * results are void (`non_finite` is set) and the chunk takes the exact path. Inlined twice, so that the
 * loop without INT8 ranges carries none of their work. */
static inline __attribute__((always_inline)) void finite_sums(const float *restrict r, const float *restrict c, uint16_t *restrict e, int n,
                                                               float rtol, float base, float floor_, int quantized, float low, float high,
                                                               float half_step, Sums *restrict out) {
    double abs_total = 0, rel_total = 0, ref_total = 0, err_total = 0, cand_total = 0, cross_total = 0;
    int64_t outside_total = 0, below_total = 0, flushed_total = 0, beyond_total = 0, below_step_total = 0;
    uint32_t max_err = 0, max_rel = 0, max_ratio = 0, max_outside = 0;
    int non_finite = 0;
    for (int block = 0; block < n; block += BLOCK) {  /* int indices (n <= CHUNK): GCC vectorizes them */
        int end = block + BLOCK < n ? block + BLOCK : n;
        float abs_sum = 0, rel_sum = 0, ref_sq = 0, err_sq = 0, cand_sq = 0, ref_cand = 0;
        int outside = 0, below = 0, flushed = 0, beyond = 0, below_step = 0;
        uint32_t block_err = max_err, block_rel = max_rel, block_ratio = max_ratio, block_outside = max_outside;
        for (int i = block; i < end; i++) {
            float ri = r[i], ci = c[i], err = fabsf(ci - ri), a = fabsf(ri);
            float limit = a * rtol + base, ratio = err / limit, rel = err / (a > floor_ ? a : floor_);
            uint32_t err_bits, rel_bits, ratio_bits;
            memcpy(&err_bits, &err, 4);
            memcpy(&rel_bits, &rel, 4);
            memcpy(&ratio_bits, &ratio, 4);
            int32_t bucket = (int32_t)(err_bits >> SKETCH_SHIFT) - SKETCH_OFFSET;
            bucket = bucket < 0 ? 0 : bucket;
            e[i] = (uint16_t)(bucket > SKETCH_BUCKETS - 1 ? SKETCH_BUCKETS - 1 : bucket);
            abs_sum += err;
            rel_sum += rel;
            ref_sq += ri * ri;
            err_sq += err * err;
            cand_sq += ci * ci;
            ref_cand += ri * ci;
            block_err = err_bits > block_err ? err_bits : block_err;
            block_rel = rel_bits > block_rel ? rel_bits : block_rel;
            block_ratio = ratio_bits > block_ratio ? ratio_bits : block_ratio;
            outside += err > limit;
            uint32_t outside_bits = err_bits & (0u - (uint32_t)(err > limit));
            block_outside = outside_bits > block_outside ? outside_bits : block_outside;
            below += (a < (float)FP16_SMALLEST_NORMAL) & (ri != 0);
            flushed += (ci == 0) & (ri != 0);
            if (quantized) {
                beyond += (ri < low) | (ri > high);
                below_step += (a < half_step) & (ri != 0);
            }
        }
        non_finite |= !isfinite(abs_sum + ref_sq + cand_sq);
        max_err = block_err; max_rel = block_rel; max_ratio = block_ratio; max_outside = block_outside;
        abs_total += abs_sum; rel_total += rel_sum; ref_total += ref_sq; err_total += err_sq;
        cand_total += cand_sq; cross_total += ref_cand;
        outside_total += outside; below_total += below; flushed_total += flushed;
        beyond_total += beyond; below_step_total += below_step;
    }
    out->abs_sum = abs_total; out->rel_sum = rel_total; out->ref_sq = ref_total; out->err_sq = err_total;
    out->cand_sq = cand_total; out->ref_cand = cross_total;
    out->outside = outside_total; out->below = below_total; out->flushed = flushed_total;
    out->beyond = beyond_total; out->below_step = below_step_total; out->non_finite = non_finite;
    out->max_err = max_err; out->max_rel = max_rel; out->max_ratio = max_ratio; out->max_outside = max_outside;
}

HOT_LOOP static void finite_sums_f32(const float *restrict r, const float *restrict c, uint16_t *restrict e, int n, float rtol,
                                     float base, float floor_, float low, float high, float half_step, int quantized, Sums *restrict out) {
    if (quantized)
        finite_sums(r, c, e, n, rtol, base, floor_, 1, low, high, half_step, out);
    else
        finite_sums(r, c, e, n, rtol, base, floor_, 0, 0, 0, 0, out);
}

static float from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* A float32 chunk: the branch-free sums, then the sketch from the buckets they left in `e` (scratch of n
 * 16-bit buckets, still in cache), and, only when some element is outside, the worst one. `lanes` is scratch of
 * 4 * SKETCH_BUCKETS 16-bit counts. Returns 0, leaving `t` untouched, when the chunk holds a NaN or an Inf. */
static int finite_chunk_f32(const float *r, const float *c, Py_ssize_t n, const Params *p, Totals *t,
                             int64_t *sketch, uint16_t *e, uint16_t (*lanes)[SKETCH_BUCKETS]) {
    const float rtol = (float)p->rtol, base = (float)p->base;
    Sums s;
    finite_sums_f32(r, c, e, (int)n, rtol, base, (float)p->rel_floor, (float)p->low, (float)p->high, (float)p->half_step, p->has_quant, &s);
    if (s.non_finite) return 0;
    t->finite += n;
    t->abs_sum += s.abs_sum; t->rel_sum += s.rel_sum; t->ref_sq += s.ref_sq;
    t->err_sq += s.err_sq; t->cand_sq += s.cand_sq; t->ref_cand += s.ref_cand;
    t->outside += s.outside; t->below_fp16_normal += s.below; t->flushed_to_zero += s.flushed;
    t->beyond_int8 += s.beyond; t->below_int8_step += s.below_step;
    if (from_bits(s.max_err) > t->max_err) t->max_err = from_bits(s.max_err);
    if (from_bits(s.max_rel) > t->max_rel) t->max_rel = from_bits(s.max_rel);
    if (from_bits(s.max_ratio) > t->tol_ratio) t->tol_ratio = from_bits(s.max_ratio);
    /* four interleaved histograms, so that runs of equal buckets do not wait on each other; 16-bit counts
     * (a lane sees at most CHUNK / 4 elements) keep all four in the first-level cache */
    memset(lanes, 0, 4 * SKETCH_BUCKETS * sizeof(uint16_t));
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++) lanes[k][e[i + k]]++;
    for (; i < n; i++) sketch[e[i]]++;
    for (int b = 0; b < SKETCH_BUCKETS; b++) sketch[b] += lanes[0][b] + lanes[1][b] + lanes[2][b] + lanes[3][b];
    /* The worst element (the first with the largest error outside) can only be in this chunk if its largest
     * error outside beats the worst so far: then it is the chunk's first outside element with that error. */
    if (s.outside && from_bits(s.max_outside) > t->worst_distance) {
        const float target = from_bits(s.max_outside);
        for (i = 0; i < n; i++) {
            float err = fabsf(c[i] - r[i]);
            if (err == target && err > fabsf(r[i]) * rtol + base) {
                worst(t, i, err, r[i], c[i]);
                break;
            }
        }
    }
    return 1;
}

static int get_buffer(PyObject *object, Py_buffer *view, int writable) {
    return PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0));
}

static char kind(const Py_buffer *view) {
    const char *format = view->format ? view->format : "B";
    if (format[0] == '<' || format[0] == '=' || format[0] == '@') format++;
    return format[0];
}

#define TOTALS 24

/* The totals buffer (the order of KERNEL_FIELDS in metrics.py) as a Totals, and back. */
static void load_totals(Totals *t, const double *v) {
    int64_t *counts[] = {&t->finite, &t->outside, &t->ref_nan, &t->ref_inf, &t->cand_nan, &t->cand_inf,
                         &t->below_fp16_normal, &t->flushed_to_zero, &t->beyond_int8, &t->below_int8_step};
    for (int k = 0; k < 10; k++) *counts[k] = (int64_t)v[k];
    double *sums[] = {&t->abs_sum, &t->rel_sum, &t->ref_sq, &t->err_sq, &t->cand_sq, &t->ref_cand, &t->max_err, &t->max_rel, &t->tol_ratio};
    for (int k = 0; k < 9; k++) *sums[k] = v[10 + k];
    t->poisoned = v[19] > 0;
    t->worst_distance = v[20];
    t->worst_index = (Py_ssize_t)v[21];
    t->worst_ref = v[22];
    t->worst_cand = v[23];
}

static void store_totals(const Totals *t, double *v) {
    const int64_t counts[] = {t->finite, t->outside, t->ref_nan, t->ref_inf, t->cand_nan, t->cand_inf,
                              t->below_fp16_normal, t->flushed_to_zero, t->beyond_int8, t->below_int8_step};
    for (int k = 0; k < 10; k++) v[k] = (double)counts[k];
    const double sums[] = {t->abs_sum, t->rel_sum, t->ref_sq, t->err_sq, t->cand_sq, t->ref_cand, t->max_err, t->max_rel, t->tol_ratio};
    for (int k = 0; k < 9; k++) v[10 + k] = sums[k];
    v[19] = t->poisoned;
    v[20] = t->worst_distance;
    v[21] = (double)t->worst_index;
    v[22] = t->worst_ref;
    v[23] = t->worst_cand;
}

/* Add one chunk's totals (worst index relative to the chunk) into the running ones. */
static void merge_totals(Totals *into, const Totals *t, Py_ssize_t offset) {
    into->finite += t->finite; into->outside += t->outside; into->ref_nan += t->ref_nan; into->ref_inf += t->ref_inf;
    into->cand_nan += t->cand_nan; into->cand_inf += t->cand_inf; into->below_fp16_normal += t->below_fp16_normal;
    into->flushed_to_zero += t->flushed_to_zero; into->beyond_int8 += t->beyond_int8; into->below_int8_step += t->below_int8_step;
    into->abs_sum += t->abs_sum; into->rel_sum += t->rel_sum; into->ref_sq += t->ref_sq; into->err_sq += t->err_sq;
    into->cand_sq += t->cand_sq; into->ref_cand += t->ref_cand;
    if (t->max_err > into->max_err) into->max_err = t->max_err;
    if (t->max_rel > into->max_rel) into->max_rel = t->max_rel;
    if (t->tol_ratio > into->tol_ratio) into->tol_ratio = t->tol_ratio;
    into->poisoned |= t->poisoned;
    if (t->worst_distance > into->worst_distance) {
        into->worst_distance = t->worst_distance;
        into->worst_index = offset + t->worst_index;
        into->worst_ref = t->worst_ref;
        into->worst_cand = t->worst_cand;
    }
}

static PyObject *py_reduce(PyObject *self, PyObject *args) {
    PyObject *ref_object, *cand_object, *quant, *totals_object, *sketch_object, *scratch_object;
    Py_ssize_t start;
    Params p;
    memset(&p, 0, sizeof p);
    if (!PyArg_ParseTuple(args, "OOdddOnOOO", &ref_object, &cand_object, &p.rtol, &p.base, &p.rel_floor, &quant, &start,
                          &totals_object, &sketch_object, &scratch_object))
        return NULL;
    if (quant != Py_None) {
        if (!PyArg_ParseTuple(quant, "ddd", &p.low, &p.high, &p.half_step)) return NULL;
        p.has_quant = 1;
    }
    Py_buffer views[5];
    PyObject *objects[5] = {ref_object, cand_object, totals_object, sketch_object, scratch_object};
    int got = 0;
    for (; got < 5; got++)
        if (get_buffer(objects[got], &views[got], got >= 2) < 0) break;
    PyObject *result = NULL;
    if (got < 5) goto done;
    Py_buffer *ref = &views[0], *cand = &views[1], *totals = &views[2], *sketch = &views[3], *scratch = &views[4];
    char rk = kind(ref), ck = kind(cand);
    Py_ssize_t n = ref->len / (ref->itemsize ? ref->itemsize : 1);
    int pair_ok = (rk == 'f' && (ck == 'f' || ck == 'e')) || (rk == 'd' && ck == 'd');
    if (!pair_ok || cand->len / cand->itemsize != n || kind(totals) != 'd' || totals->len != TOTALS * (Py_ssize_t)sizeof(double)
        || sketch->len != SKETCH_BUCKETS * (Py_ssize_t)sizeof(int64_t) || scratch->len < (Py_ssize_t)SCRATCH_BYTES) {
        PyErr_SetString(PyExc_ValueError, "reduce: float32 with float32 or float16 (or two float64) buffers of equal length, TOTALS float64 totals, "
                                          "a sketch of SKETCH_BUCKETS, SCRATCH_BYTES of scratch");
        goto done;
    }
    Totals all;
    load_totals(&all, (const double *)totals->buf);
    Py_BEGIN_ALLOW_THREADS
    uint16_t *e = (uint16_t *)scratch->buf;
    float *converted = (float *)scratch->buf + CHUNK;
    uint16_t (*lanes)[SKETCH_BUCKETS] = (uint16_t (*)[SKETCH_BUCKETS])(converted + CHUNK);
    for (Py_ssize_t first = 0; first < n; first += CHUNK) {
        Py_ssize_t size = n - first < CHUNK ? n - first : CHUNK;
        Totals t;
        memset(&t, 0, sizeof t);
        t.worst_distance = -INFINITY;
        t.worst_index = -1;
        t.worst_ref = t.worst_cand = NAN;
        int64_t *counts = (int64_t *)sketch->buf;
        if (rk == 'f') {
            const float *r = (const float *)ref->buf + first, *c = (const float *)cand->buf + first;
            if (ck == 'e') {
                halves_to_floats((const uint16_t *)cand->buf + first, converted, size);
                c = converted;
            }
            if (!(p.base > 0 && finite_chunk_f32(r, c, size, &p, &t, counts, e, lanes)))
                for (Py_ssize_t i = 0; i < size; i++) one_element(&t, &p, counts, i, r[i], c[i], 1);
        } else {
            const double *r = (const double *)ref->buf + first, *c = (const double *)cand->buf + first;
            for (Py_ssize_t i = 0; i < size; i++) one_element(&t, &p, counts, i, r[i], c[i], 0);
        }
        merge_totals(&all, &t, start + first);
    }
    Py_END_ALLOW_THREADS
    store_totals(&all, (double *)totals->buf);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&views[k]);
    return result;
}

/* What decisions.py's tolerance line needs of one output, element by element in float64, in numpy's order of
 * operations (-ffp-contract=off: no fused multiply-add; reassociation is turned off here), so the answers are
 * the definition's to the last bit: the smallest atol at the run's rtol and spread (stol times the
 * reference's absmax), the smallest rtol at its atol and spread, the elements NaN or Inf on one side only,
 * and each element's error in tolerances counted into the sketch. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-associative-math")))
#endif
static void tolerance_element(double r, double c, double atol, double rtol, double spread, int64_t *sketch, double *atol_needed,
                              double *rtol_needed, int64_t *non_finite) {
    int same = (isnan(r) && isnan(c)) || (isinf(r) && r == c);
    if (!(isfinite(r) && isfinite(c)) && !same) (*non_finite)++;
    double error = same ? 0.0 : fabs(c - r);
    if (isnan(error)) error = INFINITY;
    double magnitude = isfinite(r) ? fabs(r) : 0.0;
    double allowed = (atol + rtol * magnitude) + spread;
    double ratio = allowed > 0 ? error / allowed : (error > 0 ? INFINITY : 0.0);
    sketch_add(sketch, (float)(ratio < FLT_MAX ? ratio : FLT_MAX));
    double by_atol = (error - rtol * magnitude) - spread, excess = (error - atol) - spread;
    double by_rtol = excess > 0 ? excess / magnitude : 0.0;
    if (by_atol > *atol_needed) *atol_needed = by_atol;
    if (by_rtol > *rtol_needed) *rtol_needed = by_rtol;
}

/* tolerance_needed(ref, cand, atol, rtol, spread, sketch) -> (atol_needed, rtol_needed, non_finite): ref and
 * cand as reduce takes them; sketch: writable int64 buffer of SKETCH_BUCKETS counts, added to. */
static PyObject *py_tolerance_needed(PyObject *self, PyObject *args) {
    PyObject *ref_object, *cand_object, *sketch_object;
    double atol, rtol, spread;
    if (!PyArg_ParseTuple(args, "OOdddO", &ref_object, &cand_object, &atol, &rtol, &spread, &sketch_object)) return NULL;
    Py_buffer views[3];
    PyObject *objects[3] = {ref_object, cand_object, sketch_object};
    int got = 0;
    for (; got < 3; got++)
        if (get_buffer(objects[got], &views[got], got == 2) < 0) break;
    PyObject *result = NULL;
    if (got < 3) goto done;
    char rk = kind(&views[0]), ck = kind(&views[1]);
    Py_ssize_t n = views[0].len / (views[0].itemsize ? views[0].itemsize : 1);
    int pair_ok = (rk == 'f' && (ck == 'f' || ck == 'e')) || (rk == 'd' && ck == 'd');
    if (!pair_ok || views[1].len / views[1].itemsize != n || views[2].len != SKETCH_BUCKETS * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "tolerance_needed: float32 with float32 or float16 (or two float64) buffers of equal length, "
                                          "a sketch of SKETCH_BUCKETS");
        goto done;
    }
    double atol_needed = 0.0, rtol_needed = 0.0;
    int64_t non_finite = 0, *sketch = (int64_t *)views[2].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        double r, c;
        if (rk == 'd') {
            r = ((const double *)views[0].buf)[i], c = ((const double *)views[1].buf)[i];
        } else {
            r = ((const float *)views[0].buf)[i];
            c = ck == 'f' ? ((const float *)views[1].buf)[i] : half_to_float_table[((const uint16_t *)views[1].buf)[i]];
        }
        tolerance_element(r, c, atol, rtol, spread, sketch, &atol_needed, &rtol_needed, &non_finite);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(ddL)", atol_needed, isnan(rtol_needed) ? INFINITY : rtol_needed, (long long)non_finite);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&views[k]);
    return result;
}

/* Order-preserving integer keys of float32 values: an integer minimum and maximum vectorize. */
HOT_LOOP static void key_range_f32(const float *restrict x, Py_ssize_t n, uint32_t *restrict low, uint32_t *restrict high) {
    uint32_t lo = 0xffffffffu, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
        lo = key < lo ? key : lo;
        hi = key > hi ? key : hi;
    }
    *low = lo;
    *high = hi;
}

static float key_to_float(uint32_t key) {
    uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* range(ref) -> (min, max) of a float32 buffer in one pass, or None when it holds a NaN or an Inf. */
static PyObject *py_range(PyObject *self, PyObject *args) {
    PyObject *object;
    if (!PyArg_ParseTuple(args, "O", &object)) return NULL;
    Py_buffer view;
    if (get_buffer(object, &view, 0) < 0) return NULL;
    if (kind(&view) != 'f') {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "range: a float32 buffer");
        return NULL;
    }
    uint32_t low = 0xffffffffu, high = 0;
    Py_BEGIN_ALLOW_THREADS
    key_range_f32((const float *)view.buf, view.len / 4, &low, &high);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    float lo = key_to_float(low), hi = key_to_float(high);
    if (view.len == 0 || !isfinite(lo) || !isfinite(hi)) Py_RETURN_NONE;
    return Py_BuildValue("(dd)", (double)lo, (double)hi);
}

static PyMethodDef methods[] = {
    {"range", py_range, METH_VARARGS, "Smallest and largest value of a float32 buffer, or None if one is not finite."},
    {"reduce", py_reduce, METH_VARARGS, "Fused statistics pass over a tensor (see the module comment)."},
    {"tolerance_needed", py_tolerance_needed, METH_VARARGS, "The tolerance an output needs, and its elements' errors in tolerances (see the function's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_reduce", NULL, -1, methods};

PyMODINIT_FUNC PyInit__reduce(void) {
    for (uint32_t h = 0; h < 65536; h++) half_to_float_table[h] = half_to_float((uint16_t)h);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL) {
        PyModule_AddIntConstant(m, "SKETCH_BUCKETS", SKETCH_BUCKETS);
        PyModule_AddIntConstant(m, "CHUNK", CHUNK);
        PyModule_AddIntConstant(m, "SCRATCH_BYTES", (long)SCRATCH_BYTES);
        PyModule_AddIntConstant(m, "TOTALS", TOTALS);
    }
    return m;
}
