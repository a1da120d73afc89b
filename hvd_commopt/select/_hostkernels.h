/* What the native host kernels' files share (docs/selection.md#native-sweep). */
#ifndef HCO_HOSTKERNELS_H
#define HCO_HOSTKERNELS_H

#include <math.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HCO_X86 1
#include <immintrin.h>
#endif

extern Py_ssize_t hco_stream_min; /* bytes: smaller buffers are written with plain stores */
extern Py_ssize_t hco_sums_first_max; /* bytes: topk makes the sums of buffers up to this size first */
extern int hco_use_avx2;          /* the AVX2 paths are in use (chosen at import, _set_simd for tests) */

/* d = s byte for byte (s NULL: zero bytes); `stream`: with streaming stores where the CPU has
   them, `fence`: then ordered by an sfence before returning (else call hco_fence after the last). */
void hco_store(char *d, const char *s, int64_t n, int stream, int fence);
void hco_fence(void);

/* b holds contiguous `item`-byte items, at least n of them (n < 0: any number); else a ValueError
   "<fn>: <what> must be a contiguous buffer of <item>-byte items<longer>" and -1. */
int hco_check(Py_buffer *b, const char *fn, const char *what, Py_ssize_t item, Py_ssize_t n, const char *longer);

/* The candidate sweep of _hostkernels.c in the SIMD path chosen at run time, over [i, n): g is read
   at j - goff (a part of the addend that starts at position goff; 0 for a whole buffer), `big`:
   write y and uo with streaming stores where they are 32-byte aligned (big | 2: and leave the
   sfence to the caller, who calls hco_fence after its last sweep). */
int64_t hco_sweep_f32(const float *x, const float *g, int64_t goff, float *y, int64_t i, int64_t n, int op,
                      int32_t key, int64_t *idx, float *val, int64_t cap, int64_t *stop, const float *u, float mu,
                      float *uo, int big);
int64_t hco_sweep_f64(const double *x, const double *g, int64_t goff, double *y, int64_t i, int64_t n, int op,
                      int64_t key, int64_t *idx, double *val, int64_t cap, int64_t *stop, const double *u, double mu,
                      double *uo, int big);

/* A part of the addend g: positions [start, end) of the buffer, read from buf[0 .. end - start).
   The parts of one call cover [0, n) in order (the gradients of a bucket, not copied into it). */
typedef struct {
    int64_t start, end;
    const void *buf;
} hco_part;

/* The part holding position p (0 <= p < n), searching on from part q (the sample is ascending). */
static inline int hco_part_at(const hco_part *gp, int np, int64_t p, int q) {
    if (p < gp[q].start) q = 0;
    while (q < np - 1 && gp[q].end <= p) q++;
    return q;
}

/* g given as None, one buffer (one part, at least n items), or a tuple of (start, buffer) pairs
   covering [0, n) in order: the parts and their acquired buffers (*np of them, released with
   hco_release_parts even on error); -1 with a ValueError naming `fn` when they do not fit. */
int hco_parse_parts(PyObject *gobj, const char *fn, Py_ssize_t item, Py_ssize_t n, Py_buffer **bufs, hco_part **parts,
                    int *np);
void hco_release_parts(Py_buffer *bufs, hco_part *parts, int np);

/* The sweep over [i, n) with the addend read part by part (gp NULL: no addend); a part whose y does
   not start on a 32-byte boundary is swept in two calls, so that the rest of it streams; one
   sfence at the end. */
int64_t hco_sweep_parts_f32(const float *x, const hco_part *gp, int np, float *y, int64_t i, int64_t n, int op,
                            int32_t key, int64_t *idx, float *val, int64_t cap, int64_t *stop, const float *u,
                            float mu, float *uo, int big);
int64_t hco_sweep_parts_f64(const double *x, const hco_part *gp, int np, double *y, int64_t i, int64_t n, int op,
                            int64_t key, int64_t *idx, double *val, int64_t cap, int64_t *stop, const double *u,
                            double mu, double *uo, int big);

/* _hostkernels_topk.c */
PyObject *topk(PyObject *self, PyObject *args);

/* _hostkernels_store.c */
PyObject *scale_add(PyObject *self, PyObject *args);
PyObject *stream_store(PyObject *self, PyObject *args);
PyObject *momentum_average(PyObject *self, PyObject *args);
PyObject *hco_set_stream_min(PyObject *self, PyObject *arg);
PyObject *hco_set_sums_first_max(PyObject *self, PyObject *arg);
PyObject *hco_set_simd(PyObject *self, PyObject *arg);

/* _hostkernels_index.c */
PyObject *sparse_axpy(PyObject *self, PyObject *args);
PyObject *scattered(PyObject *self, PyObject *args);
PyObject *scatter_sum(PyObject *self, PyObject *args);

#endif
