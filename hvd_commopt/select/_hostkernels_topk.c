/* The exact top-k of one host buffer in one native call (docs/selection.md#native-topk).
 *
 * topk(x, g, y, u, mu, uo, k, sidx, j_lo, j_hi, max_retries, vals, idx)
 *     -> (v_key, candidates, retries, full_fallbacks, above_fallback, ties, finite)
 *
 * ExactTopK's algorithm (hvd_commopt/select/exact_topk.py) step for step, with no framework call
 * in between: about ten calls into NumPy and the sweep per buffer cost ~0.14 ms on a 65k-element
 * layer whose one pass takes 5 µs, so with one bucket per layer the calls, not the memory, set the
 * step time. Here:
 *
 * 0. a buffer of at most sums_first_max bytes (one that stays in cache): the sums y (and uo) in a
 *    pass of their own, so that steps 1 and 2 read them warm (docs/selection.md#native-topk);
 * 1. the sample sums s_j = x[p] + a[p] at the positions sidx (a = u*mu + g, or g, or nothing: the
 *    same roundings as the sweep), their keys, and the bracket keys lo (sample rank j_lo) and hi
 *    (rank j_hi) by histogram bin, then quickselect in the bin; no sample (sidx None): lo = 0;
 * 2. the sweep of _hostkernels.c (the very code sweep() runs, so the sums y and uo are its bits):
 *    y = x + a, candidates key(y) >= lo into growing buffers; fewer than k: lo from rank
 *    4*j_lo + 16 of the sample, or every element after max_retries (lo = 0: the sums only);
 * 3. the k-th key v among the candidates: the same value, and the same choice of the sample's hi
 *    where ExactTopK takes it (exactly k candidates >= hi, or more >= hi but fewer > hi), so the
 *    threshold it reports is the same; otherwise quickselect runs on the part that holds v, as
 *    ExactTopK's steps do: the band < hi when fewer than k keys are >= hi, else the keys > hi;
 * 4. the selection: keys > v and the lowest-index ties == v, k in all, ascending, into vals/idx.
 *
 * Keys are the bit patterns of |y| with every NaN one key above +Inf (docs/selection.md#order), so
 * the result is the Python path's bit for bit, and its counters (retries, fallbacks, ties,
 * candidates) too. finite: 0/1 from the candidates (every NaN/Inf is one unless lo is NaN,
 * docs/selection.md#finite-sweep), -1 when every element was a candidate (unknown, as there).
 * The GIL is released throughout: the progress thread runs the step's collectives meanwhile.
 */
#include "_hostkernels.h"
#include <stdlib.h>

Py_ssize_t hco_sums_first_max = 384 << 10; /* bytes: buffers up to this size get their sums first */

typedef struct {
    int64_t v, c;
    int retries, full, above, ties, finite;
    int error; /* 1 out of memory, 2 internal (fewer than k keys >= v), 3 a sample position out of range */
} hco_topk_res;

/* r-th smallest (0-based) of a[0..n), reordering a: quickselect, median-of-three Hoare partition,
   which splits runs of equal keys evenly; after 64 rounds (adversarial input) it sorts the rest. */
#define HCO_KTH(NAME, KT)                                                                        \
    static int NAME##_cmp(const void *p, const void *q) {                                       \
        KT a = *(const KT *)p, b = *(const KT *)q;                                              \
        return (a > b) - (a < b);                                                               \
    }                                                                                           \
    static KT NAME(KT *a, int64_t n, int64_t r) {                                              \
        int64_t lo = 0, hi = n - 1;                                                             \
        for (int rounds = 0; lo < hi; rounds++) {                                               \
            if (rounds == 64) {                                                                 \
                qsort(a + lo, (size_t)(hi - lo + 1), sizeof(KT), NAME##_cmp);                   \
                return a[r];                                                                    \
            }                                                                                   \
            KT p0 = a[lo], p1 = a[lo + (hi - lo) / 2], p2 = a[hi];                              \
            KT p = p0 < p1 ? (p1 < p2 ? p1 : (p0 < p2 ? p2 : p0)) : (p0 < p2 ? p0 : (p1 < p2 ? p2 : p1)); \
            int64_t i = lo, j = hi;                                                             \
            while (i <= j) {                                                                    \
                while (a[i] < p) i++;                                                           \
                while (a[j] > p) j--;                                                           \
                if (i <= j) {                                                                   \
                    KT t = a[i];                                                                \
                    a[i++] = a[j];                                                              \
                    a[j--] = t;                                                                 \
                }                                                                               \
            }                                                                                   \
            if (r <= j) hi = j;                                                                 \
            else if (r >= i) lo = i;                                                            \
            else return a[r]; /* between the parts: equal to the pivot */                      \
        }                                                                                       \
        return a[r];                                                                            \
    }
HCO_KTH(kth_i32, int32_t)
HCO_KTH(kth_i64, int64_t)

/* The r-th smallest (0-based) of the non-negative keys a[0..n), a left as it is (the retries select
   in it again): a histogram of the keys' top 11 bits finds the bin that holds rank r, and the
   quickselect runs on that bin's keys only, copied to tmp (n items). On a sample of 2048 keys the
   quickselect alone took ~7 µs per rank, most of it mispredicted branches; the two counting passes
   have none. */
#define HCO_RANK(NAME, KT, SHIFT, KTH)                                                           \
    static KT NAME(const KT *a, int64_t n, int64_t r, KT *tmp) {                                 \
        uint32_t h[2048];                                                                       \
        memset(h, 0, sizeof h);                                                                 \
        for (int64_t j = 0; j < n; j++) h[a[j] >> (SHIFT)]++;                                   \
        int64_t below = 0, b = 0;                                                               \
        while (below + h[b] <= r) below += h[b++]; /* r < n: the bin exists */                  \
        int64_t c = 0;                                                                          \
        for (int64_t j = 0; j < n; j++) tmp[c] = a[j], c += (a[j] >> (SHIFT)) == b;             \
        return KTH(tmp, c, r - below);                                                          \
    }
HCO_RANK(rank_i32, int32_t, 20, kth_i32)
HCO_RANK(rank_i64, int64_t, 52, kth_i64)

#define HCO_TOPK(NAME, FT, KT, KTH, RANK, MASK, INF, PSWEEP)                                            \
    static inline KT NAME##_key(FT v) {                                                         \
        KT b;                                                                                   \
        memcpy(&b, &v, sizeof b);                                                               \
        b &= (KT)(MASK);                                                                        \
        return b > (KT)(INF) ? (KT)(INF) + 1 : b;                                               \
    }                                                                                           \
    /* y = x + g (or + u*mu + g, made into uo) over [0, n), no candidates (an lt-0 sweep keeps \
       none); nothing to do without an addend (y is then x) */                                 \
    static void NAME##_sums(const FT *x, const hco_part *gp, int np, FT *y, const FT *u, FT mu, FT *uo, \
                            int64_t n, int big) {                                               \
        int64_t di[64], stop;                                                                   \
        FT dv[64];                                                                              \
        if (gp) PSWEEP(x, gp, np, y, 0, n, 3, 0, di, dv, 64, &stop, u, mu, uo, big);            \
    }                                                                                           \
    static void NAME(const FT *x, const hco_part *gp, int np, FT *y, const FT *u, FT mu, FT *uo, int64_t n, \
                     int64_t k, const int64_t *sidx, int64_t m, int64_t j_lo, int64_t j_hi, int max_retries, \
                     FT *vals, int64_t *oidx, hco_topk_res *res) {                              \
        KT *sk = NULL, *ck = NULL, lo = 0, hi = 0, v;                                           \
        int64_t *ci = NULL, c = 0, cap = 0;                                                     \
        FT *cv = NULL;                                                                          \
        int have_hi = 0, all = 0, q = 0;                                                        \
        const int big = n * (int64_t)sizeof(FT) >= hco_stream_min;                             \
        if (!gp) y = (FT *)x; /* no addend: the sum is x itself, nothing is written */         \
        for (int64_t j = 0; j < m; j++) { /* before anything is written */                     \
            if (sidx[j] < 0 || sidx[j] >= n) {                                                  \
                res->error = 3;                                                                 \
                goto out;                                                                       \
            }                                                                                   \
        }                                                                                       \
        if (gp && m > 0 && n * (int64_t)sizeof(FT) <= hco_sums_first_max) {                    \
            /* a buffer that stays in cache: the sums first, then the sample and the candidates \
               read them warm (the sample from cold x, g, u is a cache miss per position) */    \
            NAME##_sums(x, gp, np, y, u, mu, uo, n, big);                                       \
            x = y, gp = NULL, u = NULL;                                                         \
        }                                                                                       \
        /* 1. the bracket from the sample */                                                    \
        if (m > 0) {                                                                            \
            if (!(sk = malloc((size_t)m * 2 * sizeof(KT)))) goto oom; /* the keys, RANK's tmp */ \
            for (int64_t j = 0; j < m; j++) {                                                   \
                int64_t p = sidx[j]; /* in range: checked above */                              \
                FT s = x[p];                                                                    \
                if (gp) {                                                                       \
                    q = hco_part_at(gp, np, p, q);                                              \
                    FT gv = ((const FT *)gp[q].buf)[p - gp[q].start];                           \
                    if (u) {                                                                    \
                        FT a = u[p] * mu;                                                       \
                        a = a + gv;                                                             \
                        s = s + a;                                                              \
                    } else {                                                                    \
                        s = s + gv;                                                             \
                    }                                                                           \
                }                                                                               \
                sk[j] = NAME##_key(s);                                                          \
            }                                                                                   \
            if (j_lo <= m) lo = RANK(sk, m, m - j_lo, sk + m);                                  \
            if (j_hi >= 1) {                                                                    \
                hi = RANK(sk, m, m - j_hi, sk + m);                                             \
                have_hi = 1;                                                                    \
            }                                                                                   \
        }                                                                                       \
        /* 2. the sweep: the sums, and the candidates key >= lo; lower lo while fewer than k */ \
        for (;;) {                                                                              \
            if (lo == 0) { /* every element qualifies: the sums only */                        \
                NAME##_sums(x, gp, np, y, u, mu, uo, n, big);                                   \
                x = y, gp = NULL, u = NULL;                                                     \
                all = 1, c = n;                                                                 \
                break;                                                                          \
            }                                                                                   \
            int64_t start = 0;                                                                  \
            c = 0;                                                                              \
            while (start < n) {                                                                 \
                if (cap - c < 128) {                                                            \
                    int64_t want = cap ? 4 * cap : (n >> 5) + 128;                              \
                    want = want < n + 128 ? want : n + 128;                                     \
                    int64_t *ni = realloc(ci, (size_t)want * sizeof(int64_t));                  \
                    if (ni) ci = ni;                                                            \
                    FT *nv = ni ? realloc(cv, (size_t)want * sizeof(FT)) : NULL;                \
                    if (!nv) goto oom;                                                          \
                    cv = nv, cap = want;                                                        \
                }                                                                               \
                int64_t stop;                                                                   \
                c += PSWEEP(x, gp, np, y, start, n, 0, lo, ci + c, cv + c, cap - c, &stop, u, mu, uo, big); \
                start = stop; /* short of n: the buffers were full (fewer than 32 free) */      \
            }                                                                                   \
            x = y, gp = NULL, u = NULL; /* the sums are in y */                                 \
            if (c >= k) {                                                                       \
                all = c == n;                                                                   \
                break;                                                                          \
            }                                                                                   \
            res->retries++;                                                                     \
            j_lo = 4 * j_lo + 16;                                                               \
            if (res->retries > max_retries || j_lo > m) {                                       \
                res->full++;                                                                    \
                lo = 0;                                                                         \
            } else {                                                                            \
                lo = RANK(sk, m, m - j_lo, sk + m);                                             \
            }                                                                                   \
        }                                                                                       \
        res->c = c;                                                                             \
        const FT *val = all ? y : cv; /* every element a candidate: candidate j is position j */ \
        if (!all) {                                                                             \
            int f = lo != (KT)(INF) + 1;                                                        \
            for (int64_t j = 0; f && j < c; j++) f = NAME##_key(val[j]) < (KT)(INF);            \
            res->finite = f;                                                                    \
        }                                                                                       \
        /* 3. the k-th key among the candidates (or the sample's hi, where ExactTopK takes it) */ \
        if (!(ck = malloc((size_t)c * sizeof(KT)))) goto oom;                                   \
        int64_t a = 0, above = 0;                                                               \
        for (int64_t j = 0; j < c; j++) {                                                       \
            ck[j] = NAME##_key(val[j]);                                                         \
            a += ck[j] >= hi;                                                                   \
            above += ck[j] > hi;                                                                \
        }                                                                                       \
        if (have_hi && (a == k || (a > k && above < k))) {                                      \
            v = hi;                                                                             \
        } else if (have_hi) { /* the k-th lies in the band < hi (a < k) or among the keys > hi */ \
            res->above = a > k;                                                                 \
            int64_t b = 0, r = a < k ? k - a : k;                                               \
            for (int64_t j = 0; j < c; j++)                                                     \
                ck[b] = ck[j], b += a < k ? ck[j] < hi : ck[j] > hi; /* no branch to mispredict */ \
            v = KTH(ck, b, b - r);                                                              \
        } else {                                                                                \
            v = KTH(ck, c, c - k);                                                              \
        }                                                                                       \
        /* 4. keys > v and the lowest-index ties, k in all, ascending */                        \
        int64_t gt = 0, ge = 0;                                                                 \
        for (int64_t j = 0; j < c; j++) {                                                       \
            KT kk = NAME##_key(val[j]);                                                         \
            gt += kk > v;                                                                       \
            ge += kk >= v;                                                                      \
        }                                                                                       \
        if (ge < k) {                                                                           \
            res->error = 2;                                                                     \
            goto out;                                                                           \
        }                                                                                       \
        res->ties = ge > k;                                                                     \
        res->v = v;                                                                             \
        int64_t need = k - gt, o = 0;                                                           \
        for (int64_t j = 0; j < c && o < k; j++) {                                              \
            KT kk = NAME##_key(val[j]);                                                         \
            int take = kk > v;                                                                  \
            if (!take && kk == v && need > 0) take = 1, need--;                                 \
            if (take) {                                                                         \
                vals[o] = val[j];                                                               \
                oidx[o++] = all ? j : ci[j];                                                    \
            }                                                                                   \
        }                                                                                       \
        goto out;                                                                               \
    oom:                                                                                        \
        res->error = 1;                                                                         \
    out:                                                                                        \
        free(sk);                                                                               \
        free(ck);                                                                               \
        free(ci);                                                                               \
        free(cv);                                                                               \
    }

HCO_TOPK(topk_f32, float, int32_t, kth_i32, rank_i32, 0x7FFFFFFF, 0x7F800000, hco_sweep_parts_f32)
HCO_TOPK(topk_f64, double, int64_t, kth_i64, rank_i64, 0x7FFFFFFFFFFFFFFFLL, 0x7FF0000000000000LL, hco_sweep_parts_f64)

PyObject *topk(PyObject *self, PyObject *args) {
    Py_buffer x, y, vals, idx, u = {0}, uo = {0}, sx = {0}, *gbufs = NULL;
    hco_part *gparts = NULL;
    PyObject *gobj, *uobj, *uoobj, *sobj, *res = NULL;
    double mu;
    Py_ssize_t k, j_lo, j_hi;
    int max_retries, ng = 0, got_u = 0, got_uo = 0, got_s = 0;
    if (!PyArg_ParseTuple(args, "y*Ow*OdOnOnniw*w*", &x, &gobj, &y, &uobj, &mu, &uoobj, &k, &sobj, &j_lo, &j_hi,
                          &max_retries, &vals, &idx))
        return NULL;
    Py_ssize_t item = x.itemsize, n = item ? x.len / item : 0, m = 0;
    if ((item != 4 && item != 8) || k < 1 || k > n || j_lo < 1) {
        PyErr_SetString(PyExc_ValueError, "topk: x must hold float32 or float64, 1 <= k <= len(x), j_lo >= 1");
        goto done;
    }
    if (gobj != Py_None && hco_parse_parts(gobj, "topk", item, n, &gbufs, &gparts, &ng) < 0) goto done;
    if (uobj != Py_None) {
        if (gobj == Py_None || uoobj == Py_None) {
            PyErr_SetString(PyExc_ValueError, "topk: the momentum form needs g, u and uo");
            goto done;
        }
        if (PyObject_GetBuffer(uobj, &u, PyBUF_C_CONTIGUOUS) < 0) goto done;
        got_u = 1;
        if (PyObject_GetBuffer(uoobj, &uo, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
        got_uo = 1;
    }
    if (sobj != Py_None) {
        if (PyObject_GetBuffer(sobj, &sx, PyBUF_C_CONTIGUOUS) < 0) goto done;
        got_s = 1;
        if (hco_check(&sx, "topk", "sidx", 8, -1, "")) goto done;
        m = sx.len / 8;
    }
    const char *as_x = " at least as long as x", *k_long = " holding at least k items";
    if (hco_check(&x, "topk", "x", item, -1, "") || hco_check(&y, "topk", "y", item, n, as_x) ||
        (got_u && (hco_check(&u, "topk", "u", item, n, as_x) || hco_check(&uo, "topk", "uo", item, n, as_x))) ||
        hco_check(&vals, "topk", "vals", item, k, k_long) || hco_check(&idx, "topk", "idx", 8, k, k_long))
        goto done;
    hco_topk_res r = {0};
    r.finite = -1;
    const hco_part *gp = gobj != Py_None ? gparts : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        topk_f32((const float *)x.buf, gp, ng, (float *)y.buf, got_u ? (const float *)u.buf : NULL, (float)mu,
                 got_u ? (float *)uo.buf : NULL, n, k, got_s ? (const int64_t *)sx.buf : NULL, m, j_lo, j_hi,
                 max_retries, (float *)vals.buf, (int64_t *)idx.buf, &r);
    else
        topk_f64((const double *)x.buf, gp, ng, (double *)y.buf, got_u ? (const double *)u.buf : NULL, mu,
                 got_u ? (double *)uo.buf : NULL, n, k, got_s ? (const int64_t *)sx.buf : NULL, m, j_lo, j_hi,
                 max_retries, (double *)vals.buf, (int64_t *)idx.buf, &r);
    Py_END_ALLOW_THREADS
    if (r.error == 1)
        PyErr_NoMemory();
    else if (r.error == 2)
        PyErr_Format(PyExc_RuntimeError, "topk: internal: fewer than k=%zd keys >= the k-th", k);
    else if (r.error == 3)
        PyErr_SetString(PyExc_ValueError, "topk: a sample position lies outside x");
    else
        res = Py_BuildValue("(LLiiiii)", (long long)r.v, (long long)r.c, r.retries, r.full, r.above, r.ties,
                            r.finite);
done:
    hco_release_parts(gbufs, gparts, ng);
    if (got_u) PyBuffer_Release(&u);
    if (got_uo) PyBuffer_Release(&uo);
    if (got_s) PyBuffer_Release(&sx);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&idx);
    return res;
}
