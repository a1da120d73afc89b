/* Native host kernels of the selection's candidate sweep and of the momentum correction's
 * u = mu*u + g (docs/selection.md#native-sweep).
 *
 * sweep(x, g, y, op, key, idx, val, start[, u, mu, uo]) -> (count, stop)
 *
 * One pass over x[start:]: y = x + g (g may be None: y is then x, or a copy of x), and every
 * position whose magnitude key (the bit pattern of |y| read as a signed integer, the order of
 * hvd_commopt/select/host_numpy.py) satisfies `key_of(y) op key` goes to idx (int64, ascending) and
 * val (y's value). op: 0 ge, 1 gt, 2 le, 3 lt. It stops early when idx/val could overflow and
 * says where: the caller continues from `stop` with fresh output buffers. The momentum form
 * (u given) makes the addend in the same pass: a = u*mu + g (two roundings) goes to uo, and
 * y = x + a: the momentum correction's u' = mu*u + g and v + u' in one sweep.
 *
 * Why native: NumPy needs five operations per chunk (add, and, compare, flatnonzero, take), about
 * 2.7x one memory pass at 6.6M elements; this is one pass, at the cost of the add alone.
 *
 * Bit-identical to the NumPy kernel: the sum is one IEEE add of the same operands in the same
 * order (no contraction: built with -ffp-contract=off, and a lone add cannot contract), the key
 * is the same bit operation, and the thread's denormal mode applies to both alike. The AVX2
 * path (x86-64, chosen at run time) and the portable path give the same result.
 *
 * scale_add(t, s, g, out): out = t*s + g with s rounded to t's dtype, two roundings as torch's
 * mul then add_ make them (never an FMA: -ffp-contract=off), in one pass where the framework
 * needs two. out may be t or g.
 *
 * Streaming stores (docs/selection.md#streaming-stores): a buffer of at least `stream_min` bytes
 * (_set_stream_min; 1 MiB by default) is written with non-temporal stores, which skip the read
 * of each cache line a plain store makes first. The sweep's outputs (y, uo) and the step's
 * large zero fills and copies (stream_store) are not read again within the step, and a buffer
 * of megabytes would leave the cache before the next one anyway: the line read is pure cost,
 * one memory pass of the buffer's size. The values written are the same; only the route differs.
 * stream_store(dst, src): dst = src, byte for byte (src None: dst = 0 bytes, i.e. +0.0).
 *
 * The kernels of scattered accesses (sparse_axpy, scattered, scatter_sum) are in
 * _hostkernels_index.c; scale_add, the streaming stores and the test hooks (_set_stream_min,
 * _set_sums_first_max, _set_simd) in _hostkernels_store.c.
 */
#include "_hostkernels.h"


/* Portable path: blocks of 16, whose compare loop vectorises; only a block with a hit is
   compacted. */
#define HCO_PORTABLE(NAME, FT, KT, MASK)                                                         \
    static int64_t NAME(const FT *x, const FT *g, int64_t goff, FT *y, int64_t i, int64_t n, int op, \
                        KT key, int64_t *idx, FT *val, int64_t cap, int64_t *stop, const FT *u, FT mu, \
                        FT *uo) {                                                               \
        int64_t c = 0;                                                                          \
        const KT *yk = (const KT *)y;                                                           \
        while (i < n && c + 16 <= cap) {                                                        \
            int64_t e = i + 16 < n ? i + 16 : n;                                                \
            int any = 0;                                                                        \
            if (u) {                                                                            \
                for (int64_t j = i; j < e; j++) {                                               \
                    FT a = u[j] * mu;                                                           \
                    a = a + g[j - goff];                                                        \
                    uo[j] = a;                                                                  \
                    y[j] = x[j] + a;                                                            \
                }                                                                               \
            } else if (g) {                                                                     \
                for (int64_t j = i; j < e; j++) y[j] = x[j] + g[j - goff];                      \
            } else if (y != x) {                                                                \
                for (int64_t j = i; j < e; j++) y[j] = x[j];                                    \
            }                                                                                   \
            for (int64_t j = i; j < e; j++) {                                                   \
                KT k = yk[j] & (KT)(MASK);                                                      \
                any |= op == 0 ? k >= key : op == 1 ? k > key : op == 2 ? k <= key : k < key;   \
            }                                                                                   \
            if (any) {                                                                          \
                for (int64_t j = i; j < e; j++) {                                               \
                    KT k = yk[j] & (KT)(MASK);                                                  \
                    int hit = op == 0 ? k >= key : op == 1 ? k > key : op == 2 ? k <= key : k < key; \
                    idx[c] = j;                                                                 \
                    val[c] = y[j];                                                              \
                    c += hit;                                                                   \
                }                                                                               \
            }                                                                                   \
            i = e;                                                                              \
        }                                                                                       \
        *stop = i;                                                                              \
        return c;                                                                               \
    }

HCO_PORTABLE(sweep_f32_portable, float, int32_t, 0x7FFFFFFF)
HCO_PORTABLE(sweep_f64_portable, double, int64_t, 0x7FFFFFFFFFFFFFFFLL)

#ifdef HCO_X86
/* AVX2: 32 floats (or 16 doubles) per block; the compare gives a bit mask, whose set bits are
   the hits in ascending order. ge is "> key - 1" and lt is "not > key - 1" (keys are >= 0, so
   key - 1 cannot overflow); le is "not > key". */
#define HCO_AVX2(NAME, FT, KT, VT, SFX, ISFX, SET1, LANES, MASK, PORTABLE)                         \
    __attribute__((target("avx2"))) static int64_t NAME(const FT *x, const FT *g, int64_t goff, FT *y, int64_t i, \
                                                        int64_t n, int op, KT key, int64_t *idx, FT *val, \
                                                        int64_t cap, int64_t *stop, const FT *u, FT mu, FT *uo, \
                                                        int big) {                              \
        int64_t c = 0;                                                                          \
        /* streaming stores into a large buffer (big: the caller's choice), 32-byte aligned where \
           the loop starts (a block is 128 bytes, so it stays aligned); the hits' values are then \
           read from registers */                                                               \
        const int nty = big && y != x && (uintptr_t)(y + i) % 32 == 0;                          \
        const int ntu = big && u && (uintptr_t)(uo + i) % 32 == 0;                              \
        const FT *gg = g ? g + (i - goff) : NULL; /* g[j - goff] at j = i + LANES * b: gg[LANES * b] */ \
        const VT muv = _mm256_set1_##SFX(mu);                                                   \
        const __m256i mask = SET1(MASK);                                                        \
        const __m256i kv = SET1((op == 0 || op == 3) ? key - 1 : key);                          \
        const unsigned flip = (op >= 2) ? (unsigned)((1ull << (4 * LANES)) - 1) : 0u;           \
        for (; i + 4 * LANES <= n && c + 4 * LANES <= cap; i += 4 * LANES, gg = g ? gg + 4 * LANES : NULL) { \
            unsigned m = 0;                                                                     \
            VT sv[4];                                                                           \
            for (int b = 0; b < 4; b++) {                                                       \
                VT s;                                                                           \
                FT *yb = y + i + LANES * b;                                                     \
                if (u) {                                                                        \
                    VT a = _mm256_add_##SFX(_mm256_mul_##SFX(_mm256_loadu_##SFX(u + i + LANES * b), muv), \
                                            _mm256_loadu_##SFX(gg + LANES * b));                \
                    if (ntu)                                                                    \
                        _mm256_stream_##SFX(uo + i + LANES * b, a);                             \
                    else                                                                        \
                        _mm256_storeu_##SFX(uo + i + LANES * b, a);                             \
                    s = _mm256_add_##SFX(_mm256_loadu_##SFX(x + i + LANES * b), a);             \
                } else if (g) {                                                                 \
                    s = _mm256_add_##SFX(_mm256_loadu_##SFX(x + i + LANES * b),                 \
                                         _mm256_loadu_##SFX(gg + LANES * b));                   \
                } else {                                                                        \
                    s = _mm256_loadu_##SFX(x + i + LANES * b);                                  \
                }                                                                               \
                if (nty)                                                                        \
                    _mm256_stream_##SFX(yb, s);                                                 \
                else if (u || g || y != x)                                                      \
                    _mm256_storeu_##SFX(yb, s);                                                 \
                sv[b] = s;                                                                      \
                __m256i k = _mm256_and_si256(_mm256_cast##SFX##_si256(s), mask);                \
                m |= (unsigned)_mm256_movemask_##SFX(_mm256_castsi256_##SFX(_mm256_cmpgt_##ISFX(k, kv))) \
                     << (LANES * b);                                                            \
            }                                                                                   \
            m ^= flip;                                                                          \
            if (m) {                                                                            \
                FT hv[4 * LANES] __attribute__((aligned(32)));                                  \
                for (int b = 0; b < 4; b++) _mm256_store_##SFX(hv + LANES * b, sv[b]);          \
                while (m) {                                                                     \
                    int j = __builtin_ctz(m);                                                   \
                    idx[c] = i + j;                                                             \
                    val[c] = hv[j];                                                             \
                    c++;                                                                        \
                    m &= m - 1;                                                                 \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        if ((nty || ntu) && !(big & 2)) _mm_sfence(); /* order the streamed lines before what follows \
                                                         (big & 2: the caller fences, after its last call) */ \
        int64_t tail_stop;                                                                      \
        c += PORTABLE(x, g, goff, y, i, n, op, key, idx + c, val + c, cap - c, &tail_stop, u, mu, uo); \
        *stop = tail_stop;                                                                      \
        return c;                                                                               \
    }

HCO_AVX2(sweep_f32_avx2, float, int32_t, __m256, ps, epi32, _mm256_set1_epi32, 8, 0x7FFFFFFF, sweep_f32_portable)
HCO_AVX2(sweep_f64_avx2, double, int64_t, __m256d, pd, epi64, _mm256_set1_epi64x, 4, 0x7FFFFFFFFFFFFFFFLL,
         sweep_f64_portable)
#endif

int hco_use_avx2 = 0;

/* The sweep in the path chosen at run time, for the other kernels of the extension (the fused
   top-k of _hostkernels_topk.c makes its sums and candidates with the very code sweep() runs). */
int64_t hco_sweep_f32(const float *x, const float *g, int64_t goff, float *y, int64_t i, int64_t n, int op,
                      int32_t key, int64_t *idx, float *val, int64_t cap, int64_t *stop, const float *u, float mu,
                      float *uo, int big) {
#ifdef HCO_X86
    if (hco_use_avx2) return sweep_f32_avx2(x, g, goff, y, i, n, op, key, idx, val, cap, stop, u, mu, uo, big);
#endif
    return sweep_f32_portable(x, g, goff, y, i, n, op, key, idx, val, cap, stop, u, mu, uo);
}

int64_t hco_sweep_f64(const double *x, const double *g, int64_t goff, double *y, int64_t i, int64_t n, int op,
                      int64_t key, int64_t *idx, double *val, int64_t cap, int64_t *stop, const double *u, double mu,
                      double *uo, int big) {
#ifdef HCO_X86
    if (hco_use_avx2) return sweep_f64_avx2(x, g, goff, y, i, n, op, key, idx, val, cap, stop, u, mu, uo, big);
#endif
    return sweep_f64_portable(x, g, goff, y, i, n, op, key, idx, val, cap, stop, u, mu, uo);
}

int hco_check(Py_buffer *b, const char *fn, const char *what, Py_ssize_t item, Py_ssize_t n, const char *longer) {
    if (b->itemsize != item || !PyBuffer_IsContiguous(b, 'C') || (n >= 0 && b->len / item < n)) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be a contiguous buffer of %zd-byte items%s", fn, what, item,
                     n >= 0 ? longer : "");
        return -1;
    }
    return 0;
}

/* The sweep part by part (declared in _hostkernels.h). */
#define HCO_SWEEP_PARTS(NAME, FT, KT, SWEEP)                                                     \
    int64_t NAME(const FT *x, const hco_part *gp, int np, FT *y, int64_t i, int64_t n, int op, KT key, \
                 int64_t *idx, FT *val, int64_t cap, int64_t *stop, const FT *u, FT mu, FT *uo, int big) { \
        if (!gp) return SWEEP(x, NULL, 0, y, i, n, op, key, idx, val, cap, stop, u, mu, uo, big); \
        int64_t c = 0, f = big ? 3 : 0; /* streamed parts are fenced once, at the end */        \
        for (int q = 0; q < np && i < n; q++) {                                                 \
            while (i < gp[q].end) {                                                             \
                int64_t to = gp[q].end, st;                                                     \
                uintptr_t mis = (uintptr_t)(y + i) % 32;                                        \
                if (big && mis && mis % sizeof(FT) == 0 && i + (int64_t)((32 - mis) / sizeof(FT)) < to) \
                    to = i + (int64_t)((32 - mis) / sizeof(FT));                                \
                c += SWEEP(x, (const FT *)gp[q].buf, gp[q].start, y, i, to, op, key, idx + c, val + c, cap - c, \
                           &st, u, mu, uo, f);                                                  \
                i = st;                                                                         \
                if (st < to) break; /* the output buffers are full */                           \
            }                                                                                   \
            if (i < gp[q].end) break;                                                           \
        }                                                                                       \
        if (f) hco_fence();                                                                     \
        *stop = i;                                                                              \
        return c;                                                                               \
    }
HCO_SWEEP_PARTS(hco_sweep_parts_f32, float, int32_t, hco_sweep_f32)
HCO_SWEEP_PARTS(hco_sweep_parts_f64, double, int64_t, hco_sweep_f64)

int hco_parse_parts(PyObject *gobj, const char *fn, Py_ssize_t item, Py_ssize_t n, Py_buffer **bufs, hco_part **parts,
                    int *np) {
    int tup = PyTuple_Check(gobj);
    Py_ssize_t cnt = tup ? PyTuple_GET_SIZE(gobj) : 1;
    *np = 0;
    if (cnt < 1 || cnt > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: g must be a buffer or a non-empty tuple of (start, buffer) parts", fn);
        return -1;
    }
    *bufs = calloc((size_t)cnt, sizeof(Py_buffer));
    *parts = calloc((size_t)cnt, sizeof(hco_part));
    if (!*bufs || !*parts) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t j = 0; j < cnt; j++) {
        PyObject *b = gobj;
        Py_ssize_t start = 0;
        if (tup) {
            PyObject *pair = PyTuple_GET_ITEM(gobj, j);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                PyErr_Format(PyExc_ValueError, "%s: each part of g must be a (start, buffer) pair", fn);
                return -1;
            }
            start = PyNumber_AsSsize_t(PyTuple_GET_ITEM(pair, 0), PyExc_OverflowError);
            if (start == -1 && PyErr_Occurred()) return -1;
            b = PyTuple_GET_ITEM(pair, 1);
        }
        if (PyObject_GetBuffer(b, &(*bufs)[j], PyBUF_C_CONTIGUOUS) < 0) return -1;
        *np = (int)j + 1; /* acquired, to be released */
        if (!tup) { /* one buffer: at least as long as x, as before */
            if (hco_check(&(*bufs)[j], fn, "g", item, n, " at least as long as x")) return -1;
            (*parts)[j] = (hco_part){0, n, (*bufs)[j].buf};
            return 0;
        }
        if (hco_check(&(*bufs)[j], fn, "g", item, -1, "")) return -1;
        Py_ssize_t len = (*bufs)[j].len / item;
        if (start != at || at + len > n || (j == cnt - 1 && at + len != n)) {
            PyErr_Format(PyExc_ValueError, "%s: the parts of g must cover x in order, each starting where the "
                                           "one before ends", fn);
            return -1;
        }
        (*parts)[j] = (hco_part){start, start + len, (*bufs)[j].buf};
        at = start + len;
    }
    return 0;
}

void hco_release_parts(Py_buffer *bufs, hco_part *parts, int np) {
    for (int j = 0; j < np; j++) PyBuffer_Release(&bufs[j]);
    free(bufs);
    free(parts);
}

#define AS_X " at least as long as x"

static PyObject *sweep(PyObject *self, PyObject *args) {
    Py_buffer x, y, idx, val, u = {0}, uo = {0}, *gbufs = NULL;
    hco_part *gparts = NULL;
    int ng = 0;
    PyObject *gobj, *uobj = Py_None, *uoobj = Py_None;
    int op;
    long long key;
    Py_ssize_t start;
    double mu = 0.0;
    if (!PyArg_ParseTuple(args, "y*Ow*iLw*w*n|OdO", &x, &gobj, &y, &op, &key, &idx, &val, &start, &uobj, &mu,
                          &uoobj))
        return NULL;
    PyObject *res = NULL;
    int have_g = gobj != Py_None, have_u = 0, have_uo = 0;
    if (uobj != Py_None) {
        if (!have_g || uoobj == Py_None) {
            PyErr_SetString(PyExc_ValueError, "sweep: the momentum form needs g, u and uo");
            goto done;
        }
        if (PyObject_GetBuffer(uobj, &u, PyBUF_C_CONTIGUOUS) < 0) goto done;
        have_u = 1;
        if (PyObject_GetBuffer(uoobj, &uo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
        have_uo = 1;
    }
    Py_ssize_t item = x.itemsize, n = item ? x.len / item : 0;
    if ((item != 4 && item != 8) || op < 0 || op > 3 || start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "sweep: x must hold float32 or float64, op in 0..3, 0 <= start <= len(x)");
        goto done;
    }
    if (have_g && hco_parse_parts(gobj, "sweep", item, n, &gbufs, &gparts, &ng) < 0) goto done;
    if (hco_check(&x, "sweep", "x", item, -1, "") || hco_check(&y, "sweep", "y", item, n, AS_X) ||
        (have_u && (hco_check(&u, "sweep", "u", item, n, AS_X) || hco_check(&uo, "sweep", "uo", item, n, AS_X))) ||
        hco_check(&idx, "sweep", "idx", 8, -1, "") || hco_check(&val, "sweep", "val", item, -1, ""))
        goto done;
    int64_t cap = idx.len / 8 < val.len / item ? idx.len / 8 : val.len / item, count, stop;
    const int big = (n - start) * item >= hco_stream_min;
    Py_BEGIN_ALLOW_THREADS
    const hco_part *gp = have_g ? gparts : NULL;
    if (item == 4)
        count = hco_sweep_parts_f32((const float *)x.buf, gp, ng, (float *)y.buf, start, n, op, (int32_t)key,
                                    (int64_t *)idx.buf, (float *)val.buf, cap, &stop,
                                    have_u ? (const float *)u.buf : NULL, (float)mu, have_u ? (float *)uo.buf : NULL,
                                    big);
    else
        count = hco_sweep_parts_f64((const double *)x.buf, gp, ng, (double *)y.buf, start, n, op, (int64_t)key,
                                    (int64_t *)idx.buf, (double *)val.buf, cap, &stop,
                                    have_u ? (const double *)u.buf : NULL, mu, have_u ? (double *)uo.buf : NULL, big);
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("(LL)", (long long)count, (long long)stop);
done:
    hco_release_parts(gbufs, gparts, ng);
    if (have_u) PyBuffer_Release(&u);
    if (have_uo) PyBuffer_Release(&uo);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&val);
    return res;
}

static PyMethodDef methods[] = {
    {"sweep", sweep, METH_VARARGS, "sweep(x, g, y, op, key, idx, val, start) -> (count, stop)"},
    {"scale_add", scale_add, METH_VARARGS, "scale_add(t, s, g, out): out = t*s + g"},
    {"momentum_average", momentum_average, METH_VARARGS,
     "momentum_average(x, post, u, mu, uo) -> finite: uo = u*mu + x*post, and whether x*post is finite"},
    {"stream_store", stream_store, METH_VARARGS, "stream_store(dst, src_or_None): dst = src (or zeros)"},
    {"sparse_axpy", sparse_axpy, METH_VARARGS, "sparse_axpy(idx, vals, alpha, starts, params, tmp): p[idx] += alpha*vals"},
    {"scattered", scattered, METH_VARARGS,
     "scattered(op, x, idx[, other]): 0 take into other, 1 x[idx] += other in order, 2 x[idx] = 0"},
    {"scatter_sum", scatter_sum, METH_VARARGS,
     "scatter_sum(out, idx, vals, scale, sums) -> finite, or None: out = scatter_add(0, idx, vals)*scale"},
    {"topk", topk, METH_VARARGS,
     "topk(x, g, y, u, mu, uo, k, sidx, j_lo, j_hi, max_retries, vals, idx) -> (v_key, c, retries, full, above, ties, "
     "finite)"},
    {"_set_stream_min", hco_set_stream_min, METH_O, "_set_stream_min(bytes) -> previous (-1: never stream)"},
    {"_set_sums_first_max", hco_set_sums_first_max, METH_O, "_set_sums_first_max(bytes) -> previous (-1: never)"},
    {"_set_simd", hco_set_simd, METH_O, "_set_simd(on) -> 'avx2' | 'portable' (for tests)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hvd_commopt.select._hostkernels",
                                    "Native host kernels: the selection sweep and the momentum's scale-add (docs/selection.md#native-sweep).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__hostkernels(void) {
#ifdef HCO_X86
    __builtin_cpu_init();
    hco_use_avx2 = __builtin_cpu_supports("avx2");
#endif
    PyObject *m = PyModule_Create(&module);
    /* the Python side refuses a build whose functions are not the ones it calls
       (hvd_commopt/select/host_native.py: KERNELS_VERSION); raise it with every added entry */
    if (m != NULL && PyModule_AddIntConstant(m, "KERNELS_VERSION", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
