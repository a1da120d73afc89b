/* The momentum's scale-add, the streaming stores and the extension's test hooks
 * (docs/selection.md#native-sweep, docs/selection.md#streaming-stores).
 *
 * scale_add(t, s, g, out): out = t*s + g with s rounded to t's dtype, two roundings as torch's
 * mul then add_ make them (never an FMA: -ffp-contract=off), in one pass where the framework
 * needs two. out may be t or g.
 *
 * stream_store(dst, src): dst = src, byte for byte (src None: dst = 0 bytes, i.e. +0.0), with
 * non-temporal stores for a buffer of at least `hco_stream_min` bytes (1 MiB by default).
 *
 * _set_stream_min, _set_sums_first_max, _set_simd: private hooks for tests and benchmarks, which
 * compare the routes in one process (process-global, not synchronised: set them between calls).
 */
#include "_hostkernels.h"

Py_ssize_t hco_stream_min = 1 << 20; /* bytes: smaller buffers are written with plain stores */

#define AS_X " at least as long as x"

#define HCO_SCALE_ADD(NAME, FT)                                                                  \
    static void NAME(const FT *t, FT s, const FT *g, FT *out, int64_t n) {                      \
        for (int64_t i = 0; i < n; i++) {                                                       \
            FT p = t[i] * s;                                                                    \
            out[i] = p + g[i];                                                                  \
        }                                                                                       \
    }
HCO_SCALE_ADD(scale_add_f32, float)
HCO_SCALE_ADD(scale_add_f64, double)

PyObject *scale_add(PyObject *self, PyObject *args) {
    Py_buffer t, g, out;
    double s;
    if (!PyArg_ParseTuple(args, "y*dy*w*", &t, &s, &g, &out)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t item = t.itemsize, n = item ? t.len / item : 0;
    if ((item != 4 && item != 8) || hco_check(&t, "scale_add", "t", item, -1, "") ||
        hco_check(&g, "scale_add", "g", item, n, AS_X) || hco_check(&out, "scale_add", "out", item, n, AS_X)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "scale_add: float32 or float64 buffers expected");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        scale_add_f32((const float *)t.buf, (float)s, (const float *)g.buf, (float *)out.buf, n);
    else
        scale_add_f64((const double *)t.buf, s, (const double *)g.buf, (double *)out.buf, n);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&t);
    PyBuffer_Release(&g);
    PyBuffer_Release(&out);
    return res;
}


/* dst = src byte for byte (src NULL: zeros), with streaming stores; `fence` ends with an sfence
   (a caller writing many pieces fences once, after the last). */
#ifdef HCO_X86
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, int64_t n, int fence) {
    int64_t i = 0;
    while (i < n && (uintptr_t)(d + i) % 32) {
        d[i] = s ? s[i] : 0;
        i++;
    }
    const __m256i z = _mm256_setzero_si256();
    for (; i + 32 <= n; i += 32)
        _mm256_stream_si256((__m256i *)(d + i), s ? _mm256_loadu_si256((const __m256i *)(s + i)) : z);
    if (fence) _mm_sfence();
    for (; i < n; i++) d[i] = s ? s[i] : 0;
}
#endif

void hco_store(char *d, const char *s, int64_t n, int stream, int fence) {
#ifdef HCO_X86
    if (stream && hco_use_avx2) {
        stream_avx2(d, s, n, fence);
        return;
    }
#endif
    if (s)
        memmove(d, s, n);
    else
        memset(d, 0, n);
}

void hco_fence(void) {
#ifdef HCO_X86
    if (hco_use_avx2) _mm_sfence();
#endif
}

PyObject *stream_store(PyObject *self, PyObject *args) {
    Py_buffer d, s = {0};
    PyObject *sobj;
    if (!PyArg_ParseTuple(args, "w*O", &d, &sobj)) return NULL;
    int have_s = sobj != Py_None;
    if (have_s && PyObject_GetBuffer(sobj, &s, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    PyObject *res = NULL;
    if (!PyBuffer_IsContiguous(&d, 'C') || (have_s && s.len != d.len)) {
        PyErr_SetString(PyExc_ValueError, "stream_store: dst must be contiguous and src (when given) of the same size");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    hco_store((char *)d.buf, have_s ? (const char *)s.buf : NULL, d.len, d.len >= hco_stream_min, 1);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    if (have_s) PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return res;
}


PyObject *hco_set_stream_min(PyObject *self, PyObject *arg) {
    /* Buffers of at least this many bytes are written with streaming stores (-1: never); returns
       the previous setting (benchmarks compare the two in one process). */
    Py_ssize_t v = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t prev = hco_stream_min;
    hco_stream_min = v < 0 ? PY_SSIZE_T_MAX : v;
    return PyLong_FromSsize_t(prev == PY_SSIZE_T_MAX ? -1 : prev);
}

PyObject *hco_set_sums_first_max(PyObject *self, PyObject *arg) {
    /* topk makes the sums of buffers of up to this many bytes in a pass of their own before the
       sample (-1: never); returns the previous setting (tests and benchmarks compare the routes). */
    Py_ssize_t v = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t prev = hco_sums_first_max;
    hco_sums_first_max = v < 0 ? -1 : v;
    return PyLong_FromSsize_t(prev);
}

PyObject *hco_set_simd(PyObject *self, PyObject *arg) {
    /* For tests: 0 forces the portable path, 1 the AVX2 one where the CPU has it. Returns the
       path now in use ("avx2" or "portable"). */
    int want = PyObject_IsTrue(arg);
    if (want < 0) return NULL;
#ifdef HCO_X86
    hco_use_avx2 = want && __builtin_cpu_supports("avx2");
#else
    hco_use_avx2 = 0;
#endif
    return PyUnicode_FromString(hco_use_avx2 ? "avx2" : "portable");
}


/* momentum_average(x, post, u, mu, uo) -> finite: the momentum of a bucket reduced dense
 * (docs/auto-compression.md#dense-path), in one pass: g = x*post (post rounded to x's dtype; no
 * multiply when post is 1), u' = u*mu + g (two roundings, as torch's mul_ then add_) written to
 * uo and handed back in x, and whether every g is finite (no NaN/Inf: an exponent of all ones,
 * tested on the bits, which vectorises). Where g is not finite the caller keeps u as it was (uo
 * is a second buffer) and x holds what S-SGD's optimizer would step with, u' (non-finite where g
 * is). uo must not overlap x. */
#define HCO_MOMENTUM_LOOP(FT, BT, EXP, G)                                                         \
    for (int64_t i = 0; i < n; i++) {                                                           \
        FT g = G;                                                                               \
        BT b;                                                                                   \
        memcpy(&b, &g, sizeof b);                                                               \
        bad |= (BT)((b & EXP) == EXP);                                                          \
        FT p = u[i] * mu;                                                                       \
        p = p + g;                                                                              \
        uo[i] = p;                                                                              \
        x[i] = p;                                                                               \
    }
#define HCO_MOMENTUM_AVERAGE(NAME, ATTR, FT, BT, EXP)                                             \
    ATTR static int NAME(FT *x, FT post, int scale, const FT *u, FT mu, FT *uo, int64_t n) { \
        BT bad = 0;                                                                             \
        if (scale) {                                                                            \
            HCO_MOMENTUM_LOOP(FT, BT, EXP, x[i] * post)                                         \
        } else {                                                                                \
            HCO_MOMENTUM_LOOP(FT, BT, EXP, x[i])                                                \
        }                                                                                       \
        return bad == 0;                                                                        \
    }
HCO_MOMENTUM_AVERAGE(momentum_average_f32, , float, uint32_t, UINT32_C(0x7f800000))
HCO_MOMENTUM_AVERAGE(momentum_average_f64, , double, uint64_t, UINT64_C(0x7ff0000000000000))
#ifdef HCO_X86
/* the same loops compiled for AVX2 (chosen at run time; no FMA: the target adds none, and
   -ffp-contract=off forbids contraction anyway) */
HCO_MOMENTUM_AVERAGE(momentum_average_f32_avx2, __attribute__((target("avx2"))), float, uint32_t, UINT32_C(0x7f800000))
HCO_MOMENTUM_AVERAGE(momentum_average_f64_avx2, __attribute__((target("avx2"))), double, uint64_t,
                     UINT64_C(0x7ff0000000000000))
#endif

PyObject *momentum_average(PyObject *self, PyObject *args) {
    Py_buffer x, u, uo;
    double post, mu;
    if (!PyArg_ParseTuple(args, "w*dy*dw*", &x, &post, &u, &mu, &uo)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t item = x.itemsize, n = item ? x.len / item : 0;
    if ((item != 4 && item != 8) || hco_check(&x, "momentum_average", "x", item, -1, "") ||
        hco_check(&u, "momentum_average", "u", item, n, AS_X) ||
        hco_check(&uo, "momentum_average", "uo", item, n, AS_X)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "momentum_average: float32 or float64 buffers expected");
        goto done;
    }
    int ok, scale = post != 1.0;
    Py_BEGIN_ALLOW_THREADS
#ifdef HCO_X86
    if (hco_use_avx2 && item == 4)
        ok = momentum_average_f32_avx2((float *)x.buf, (float)post, scale, (const float *)u.buf, (float)mu,
                                       (float *)uo.buf, n);
    else if (hco_use_avx2)
        ok = momentum_average_f64_avx2((double *)x.buf, post, scale, (const double *)u.buf, mu,
                                       (double *)uo.buf, n);
    else
#endif
    if (item == 4)
        ok = momentum_average_f32((float *)x.buf, (float)post, scale, (const float *)u.buf, (float)mu,
                                  (float *)uo.buf, n);
    else
        ok = momentum_average_f64((double *)x.buf, post, scale, (const double *)u.buf, mu, (double *)uo.buf, n);
    Py_END_ALLOW_THREADS
    res = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&u);
    PyBuffer_Release(&uo);
    return res;
}
