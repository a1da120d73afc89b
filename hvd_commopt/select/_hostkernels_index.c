/* Native kernels of scattered accesses: the sparse result, the sparse update, index gathers and
 * fills (docs/selection.md#random-access).
 *
 * sparse_axpy(idx, vals, alpha, starts, params, tmp): the SGD update p += alpha * g of a gradient
 * that is +0 except at idx, where it holds vals (docs/wrapper.md#sparse-update). The positions
 * index a bucket whose members, the parameters, start at starts[j]; each new value is one fused
 * multiply-add fma(v, alpha, p) (one rounding, as ATen's add(alpha=) computes it: checked at run
 * time by the caller), all read first into tmp and then written, so a position listed twice gets
 * the same value twice, never the update applied twice.
 *
 * scattered(op, x, idx[, other]), op 0 take / 1 scatter_add / 2 zero_at: out[j] = x[idx[j]];
 * x[idx[j]] += vals[j] in the order of j (the additions ATen's index_add_ makes, in its order);
 * x[idx[j]] = 0 bytes (+0.0). The positions are scattered over buffers of megabytes, so each
 * access misses the cache: the loops prefetch HCO_AHEAD entries ahead, which overlaps the misses
 * (docs/selection.md#random-access).
 *
 * scatter_sum(out, idx, vals, scale, sums) -> finite, or None: the sparse exchange's result,
 * out = scatter_add(zeros(n), idx, vals) * scale, with sums[j] = out[idx[j]] and whether every sum
 * is finite (docs/selection.md#scatter-sum). idx is the concatenation of the ranks' selections,
 * each ascending, so it splits into a few ascending runs; the kernel builds out one chunk of
 * HCO_CHUNK elements at a time in a buffer that stays in L1 (zeroed, then each run's entries of
 * the chunk added, run after run), and writes the chunk out with streaming stores. That is one
 * write pass of out and no scattered access to it, where zeroing it and then adding into it at
 * k·P scattered positions misses the cache at each of them. The bits are the plain path's: every
 * position starts at +0.0 and gets its entries added in the order of j (runs are consecutive in
 * j), and a scaled sum is one multiply by scale rounded to the dtype (ATen's mul by a Python
 * float), written back to every entry of its position. None, with nothing written, when idx has
 * more than HCO_RUNS runs: the caller takes the plain path.
 */
#include "_hostkernels.h"

#define HCO_AHEAD 16 /* entries between a prefetch and its use */

/* The member of a bucket holding position i: starts[] ascending, m members, starts[m] = total.
   `hint` (the last member found) makes ascending runs of positions O(1) per entry. */
static inline int64_t member_of(const int64_t *starts, int64_t m, int64_t i, int64_t hint) {
    if (i >= starts[hint] && i < starts[hint + 1]) return hint;
    int64_t lo = 0, hi = m;  /* the last j with starts[j] <= i */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (starts[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

/* sparse_axpy's two passes in dtype T: new values into tmp (prefetching the scattered position
   HCO_AHEAD entries ahead), then written, so a repeated position is written twice with one value. */
#define HCO_AXPY(T, FMA, ALPHA)                                                                  \
    const T *v = (const T *)vals.buf, a = (ALPHA);                                               \
    T *t = (T *)tmp.buf;                                                                         \
    for (Py_ssize_t j = 0; j < n; j++) {                                                         \
        if (j + HCO_AHEAD < n) {                                                                 \
            int64_t q = member_of(st, m, ix[j + HCO_AHEAD], h);                                  \
            __builtin_prefetch(((T *)pp[q]) + (ix[j + HCO_AHEAD] - st[q]), 1);                    \
        }                                                                                        \
        h = member_of(st, m, ix[j], h);                                                          \
        t[j] = FMA(v[j], a, ((T *)pp[h])[ix[j] - st[h]]);                                        \
    }                                                                                            \
    for (Py_ssize_t j = 0; j < n; j++) {                                                         \
        h = member_of(st, m, ix[j], h);                                                          \
        ((T *)pp[h])[ix[j] - st[h]] = t[j];                                                      \
    }

PyObject *sparse_axpy(PyObject *self, PyObject *args) {
    Py_buffer idx, vals, starts, tmp;
    double alpha;
    PyObject *plist;
    if (!PyArg_ParseTuple(args, "y*y*dy*Ow*", &idx, &vals, &alpha, &starts, &plist, &tmp)) return NULL;
    PyObject *res = NULL, *seq = NULL;
    Py_buffer *pb = NULL;
    char **pp = NULL;
    Py_ssize_t got = 0, item = vals.itemsize, n = idx.len / 8, m = starts.len / 8 - 1;
    if (idx.itemsize != 8 || (item != 4 && item != 8) || vals.len / item != n || starts.itemsize != 8 || m < 1 ||
        tmp.itemsize != item || tmp.len / item < n) {
        PyErr_SetString(PyExc_ValueError, "sparse_axpy: int64 idx, float32/float64 vals of idx's length, int64 starts "
                                          "(members + 1) and a tmp buffer of vals' dtype at least as long expected");
        goto done;
    }
    seq = PySequence_Fast(plist, "sparse_axpy: params must be a sequence of buffers");
    if (!seq) goto done;
    if (PySequence_Fast_GET_SIZE(seq) != m) {
        PyErr_SetString(PyExc_ValueError, "sparse_axpy: one param buffer per member of starts expected");
        goto done;
    }
    const int64_t *st = (const int64_t *)starts.buf, *ix = (const int64_t *)idx.buf;
    pb = PyMem_Calloc(m, sizeof(Py_buffer));
    pp = PyMem_Calloc(m, sizeof(char *));
    if (!pb || !pp) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < m; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &pb[got], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            goto done;
        if (pb[got].itemsize != item || pb[got].len / item != st[got + 1] - st[got]) {
            got++;
            PyErr_SetString(PyExc_ValueError, "sparse_axpy: a param buffer's dtype or size disagrees with vals/starts");
            goto done;
        }
        pp[got] = (char *)pb[got].buf;
    }
    for (Py_ssize_t j = 0; j < n; j++)
        if (ix[j] < st[0] || ix[j] >= st[m]) {
            PyErr_SetString(PyExc_IndexError, "sparse_axpy: a position lies outside the bucket");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    int64_t h = 0;
    if (item == 4) {
        HCO_AXPY(float, fmaf, (float)alpha)
    } else {
        HCO_AXPY(double, fma, alpha)
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    for (Py_ssize_t j = 0; j < got; j++) PyBuffer_Release(&pb[j]);
    PyMem_Free(pb);
    PyMem_Free(pp);
    Py_XDECREF(seq);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&tmp);
    return res;
}


/* The three scattered accesses, one loop each over idx with the prefetch HCO_AHEAD entries ahead:
   0 take (out[j] = x[idx[j]]), 1 scatter_add (x[idx[j]] += v[j], floats), 2 zero_at (x[idx[j]] = 0). */
#define HCO_SCATTERED(T, ACCESS, RW)                                                             \
    for (Py_ssize_t j = 0; j < k; j++) {                                                         \
        if (j + HCO_AHEAD < k) __builtin_prefetch((T *)xb + ix[j + HCO_AHEAD], RW);               \
        ACCESS;                                                                                  \
    }
#define HCO_BY_SIZE(OP, RW)                                                                      \
    if (item == 8) { HCO_SCATTERED(int64_t, OP(int64_t), RW) }                                   \
    else if (item == 4) { HCO_SCATTERED(int32_t, OP(int32_t), RW) }                              \
    else if (item == 2) { HCO_SCATTERED(int16_t, OP(int16_t), RW) }                              \
    else { HCO_SCATTERED(int8_t, OP(int8_t), RW) }
#define HCO_TAKE(T) (((T *)ob)[j] = ((const T *)xb)[ix[j]])
#define HCO_ZERO(T) (((T *)xb)[ix[j]] = 0)

PyObject *scattered(PyObject *self, PyObject *args) {
    int op;
    Py_buffer x, idx, o = {0};
    PyObject *oobj = Py_None;
    if (!PyArg_ParseTuple(args, "iw*y*|O", &op, &x, &idx, &oobj)) return NULL;
    PyObject *res = NULL;
    int have_o = 0;
    Py_ssize_t item = x.itemsize, k = idx.len / 8, n = item ? x.len / item : 0;
    if (oobj != Py_None) {
        if (PyObject_GetBuffer(oobj, &o, op == 0 ? PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE : PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        have_o = 1;
    }
    if (op < 0 || op > 2 || idx.itemsize != 8 || (item != 1 && item != 2 && item != 4 && item != 8) ||
        (op < 2 && (!have_o || o.itemsize != item || o.len / item < k)) ||
        (op == 1 && ((item != 4 && item != 8) || o.len / item != k))) {
        PyErr_SetString(PyExc_ValueError, "scattered: op 0 (take, out) / 1 (scatter_add, float vals) / 2 (zero_at), "
                                          "int64 idx, and an out or vals buffer of x's item size as long as idx");
        goto done;
    }
    const int64_t *ix = (const int64_t *)idx.buf;
    for (Py_ssize_t j = 0; j < k; j++)
        if (ix[j] < 0 || ix[j] >= n) {
            PyErr_Format(PyExc_IndexError, "scattered: index %lld is outside [0, %zd)", (long long)ix[j], n);
            goto done;
        }
    char *xb = (char *)x.buf, *ob = have_o ? (char *)o.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (op == 0) {
        HCO_BY_SIZE(HCO_TAKE, 0)
    } else if (op == 2) {
        HCO_BY_SIZE(HCO_ZERO, 1)
    } else if (item == 4) {
        HCO_SCATTERED(float, (((float *)xb)[ix[j]] += ((const float *)ob)[j]), 1)
    } else {
        HCO_SCATTERED(double, (((double *)xb)[ix[j]] += ((const double *)ob)[j]), 1)
    }
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    if (have_o) PyBuffer_Release(&o);
    PyBuffer_Release(&x);
    PyBuffer_Release(&idx);
    return res;
}


#define HCO_CHUNK 1024 /* elements built at a time: 4 KiB of float32, 8 KiB of float64, in L1 */
#define HCO_RUNS 64    /* ascending runs of idx the chunked build follows (one per rank, usually) */

/* d = the chunk in b (n bytes; b 32-byte aligned where d is), which is left zeroed for the next
   chunk: one loop over the chunk where a copy and a memset make two. With AVX2, streaming stores
   where `stream`. */
#ifdef HCO_X86
__attribute__((target("avx2"))) static void flush_avx2(char *d, char *b, int64_t n, int stream) {
    int64_t i = 0;
    const __m256i z = _mm256_setzero_si256();
    for (; i < n && (uintptr_t)(d + i) % 32; i++) d[i] = b[i], b[i] = 0;
    if (stream)
        for (; i + 32 <= n; i += 32) {
            _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(b + i)));
            _mm256_storeu_si256((__m256i *)(b + i), z);
        }
    else
        for (; i + 32 <= n; i += 32) {
            _mm256_store_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(b + i)));
            _mm256_storeu_si256((__m256i *)(b + i), z);
        }
    for (; i < n; i++) d[i] = b[i], b[i] = 0;
}
#endif

static void flush_chunk(char *d, char *b, int64_t n, int stream) {
#ifdef HCO_X86
    if (hco_use_avx2) {
        flush_avx2(d, b, n, stream);
        return;
    }
#endif
    memcpy(d, b, n);
    memset(b, 0, n);
}

/* scatter_sum's chunk loop in dtype T over `runs` runs of idx: ip[r] the run's next entry, ie[r]
   its end; ib[r] its first entry in the chunk. `area` holds a chunk and a page more: the chunk's
   buffer sits half a page off out's chunks (a chunk is whole pages), so reading it back never
   aliases, modulo 4 KiB, the streaming stores just made to out (which stalls the reads). */
#define HCO_SCATTER_SUM(NAME, T)                                                                 \
    static int NAME(T *o, int64_t n, const int64_t *ix, const T *v, T sc, int scaled, T *sm,     \
                    int runs, int64_t *ip, const int64_t *ie, int stream, char *area) {           \
        int64_t ib[HCO_RUNS];                                                                    \
        int finite = 1;                                                                          \
        T *buf = (T *)(area + ((uintptr_t)o + 2048 - (uintptr_t)area) % 4096);                   \
        memset(buf, 0, HCO_CHUNK * sizeof(T));                                                   \
        for (int64_t c0 = 0; c0 < n; c0 += HCO_CHUNK) {                                          \
            const int64_t c1 = c0 + HCO_CHUNK < n ? c0 + HCO_CHUNK : n;                          \
            for (int r = 0; r < runs; r++) {                                                     \
                int64_t j = ip[r];                                                               \
                ib[r] = j;                                                                       \
                for (; j < ie[r] && ix[j] < c1; j++) buf[ix[j] - c0] += v[j];                    \
                ip[r] = j;                                                                       \
            }                                                                                    \
            for (int r = 0; r < runs; r++)                                                       \
                for (int64_t j = ib[r]; j < ip[r]; j++) {                                        \
                    T s = buf[ix[j] - c0];                                                       \
                    if (scaled) s = s * sc;                                                      \
                    sm[j] = s;                                                                   \
                    finite &= isfinite(s) != 0;                                                  \
                }                                                                                \
            if (scaled)                                                                          \
                for (int r = 0; r < runs; r++)                                                   \
                    for (int64_t j = ib[r]; j < ip[r]; j++) buf[ix[j] - c0] = sm[j];             \
            flush_chunk((char *)(o + c0), (char *)buf, (c1 - c0) * (int64_t)sizeof(T), stream);  \
        }                                                                                        \
        if (stream) hco_fence();                                                                 \
        return finite;                                                                           \
    }

HCO_SCATTER_SUM(scatter_sum_f32, float)
HCO_SCATTER_SUM(scatter_sum_f64, double)

PyObject *scatter_sum(PyObject *self, PyObject *args) {
    Py_buffer out, idx, vals, sums;
    double scale;
    if (!PyArg_ParseTuple(args, "w*y*y*dw*", &out, &idx, &vals, &scale, &sums)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t item = out.itemsize, n = item ? out.len / item : 0, m = idx.len / 8;
    if ((item != 4 && item != 8) || idx.itemsize != 8 || vals.itemsize != item || vals.len / item != m ||
        sums.itemsize != item || sums.len / item != m || !PyBuffer_IsContiguous(&out, 'C')) {
        PyErr_SetString(PyExc_ValueError, "scatter_sum: a float32/float64 out, int64 idx, and vals and sums of out's "
                                          "dtype as long as idx expected");
        goto done;
    }
    const int64_t *ix = (const int64_t *)idx.buf;
    int64_t ip[HCO_RUNS], ie[HCO_RUNS];
    int runs = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (ix[j] < 0 || ix[j] >= n) {
            PyErr_Format(PyExc_IndexError, "scatter_sum: index %lld is outside [0, %zd)", (long long)ix[j], n);
            goto done;
        }
        if (j == 0 || ix[j] < ix[j - 1]) {
            if (runs == HCO_RUNS) {
                res = Py_None;  /* too many runs: nothing written, the caller's plain path */
                Py_INCREF(res);
                goto done;
            }
            if (runs) ie[runs - 1] = j;
            ip[runs++] = j;
        }
    }
    if (runs) ie[runs - 1] = m;
    static _Thread_local char area[HCO_CHUNK * 8 + 4096];
    int finite;
    const int scaled = scale != 1.0, stream = out.len >= hco_stream_min;
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        finite = scatter_sum_f32((float *)out.buf, n, ix, (const float *)vals.buf, (float)scale, scaled,
                                 (float *)sums.buf, runs, ip, ie, stream, area);
    else
        finite = scatter_sum_f64((double *)out.buf, n, ix, (const double *)vals.buf, scale, scaled,
                                 (double *)sums.buf, runs, ip, ie, stream, area);
    Py_END_ALLOW_THREADS
    res = PyBool_FromLong(finite);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&sums);
    return res;
}
