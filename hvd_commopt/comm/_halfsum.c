/* The sum step of the MPI backend's half-precision ring allreduce, in one pass
 * (hvd_commopt/comm/half_sum.py, docs/backends.md#half-ring).
 *
 * bf16_add(dst, src): dst[i] = bf16(float32(dst[i]) + float32(src[i])) over bfloat16 bit
 * patterns carried as uint16, each addition done in float32 and rounded to nearest even: the bits
 * of hvd_commopt.dtypes' NumPy route (half_to_float32, then float32_to_half), which takes about
 * ten passes and three temporaries over the chunk where this takes one pass and none.
 * Built optional (setup.py): without a C compiler the NumPy route runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t bf16_sum(uint16_t a, uint16_t b) {
    uint32_t ua = (uint32_t)a << 16, ub = (uint32_t)b << 16, u;
    float fa, fb, s;
    memcpy(&fa, &ua, 4);
    memcpy(&fb, &ub, 4);
    s = fa + fb;
    memcpy(&u, &s, 4);
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16); /* float32_to_half's rounding */
}

static PyObject *bf16_add(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src)) return NULL;
    PyObject *res = NULL;
    if (dst.len != src.len || dst.len % 2) {
        PyErr_Format(PyExc_ValueError, "bf16_add: dst has %zd bytes and src %zd; equal even lengths expected",
                     dst.len, src.len);
        goto done;
    }
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "bf16_add: contiguous buffers expected");
        goto done;
    }
    {
        uint16_t *d = (uint16_t *)dst.buf;
        const uint16_t *s = (const uint16_t *)src.buf;
        Py_ssize_t n = dst.len / 2;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) d[i] = bf16_sum(d[i], s[i]);
        Py_END_ALLOW_THREADS
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return res;
}

static PyMethodDef methods[] = {
    {"bf16_add", bf16_add, METH_VARARGS, "bf16_add(dst, src): dst = bf16(dst + src), bfloat16 bits as uint16"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hvd_commopt.comm._halfsum",
                                    "The half-precision ring allreduce's sum step (docs/backends.md#half-ring).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__halfsum(void) { return PyModule_Create(&module); }
