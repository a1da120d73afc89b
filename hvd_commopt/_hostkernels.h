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

/* _hostkernels_index.c */
PyObject *sparse_axpy(PyObject *self, PyObject *args);
PyObject *scattered(PyObject *self, PyObject *args);
PyObject *scatter_sum(PyObject *self, PyObject *args);

#endif
