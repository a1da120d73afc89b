/* What the native host kernels' two files share (docs/selection.md#native-sweep). */
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
extern int hco_use_avx2;          /* the AVX2 paths are in use (chosen at import, set_simd for tests) */

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

/* _hostkernels_topk.c */
PyObject *topk(PyObject *self, PyObject *args);

/* _hostkernels_index.c */
PyObject *sparse_axpy(PyObject *self, PyObject *args);
PyObject *scattered(PyObject *self, PyObject *args);
PyObject *scatter_sum(PyObject *self, PyObject *args);

#endif
