/* The low-bit quantiser's encoding and decoding on host memory, one pass each
 * (hvd_commopt/compress/quant_native.py, docs/quantize.md#native).
 *
 * encode(x, bits, block, out, dec): x (float32, n) cut into blocks of `block`; out (uint8,
 * encoded_bytes(n)) receives the float32 scales max|block| / q, then the codes
 * clip(rint(x / s'), -q, q) + q packed `bits` bits each, least significant bit first (s' = s where
 * s > 0, else 1); dec (float32, n) receives the decoded values (rint(...) clipped) * s. These are
 * the bits of hvd_commopt.numpy_ops.NumpyOps.quantize_blocks + pack_bits, which take a dozen
 * passes and temporaries over the bucket where this reads each block once (it stays in L1).
 *
 * decode(buf, n, bits, block, out, accumulate): out = (code - q) * s, or out += that (the owner's
 * sum of the P parts it received, in the order of the calls).
 *
 * The float32 arithmetic is the reference's: one division by q, one by s', rint (ties to even, the
 * default rounding mode), one product; built with -ffp-contract=off so no product is fused into
 * an addition. The GIL is released while a kernel runs: the progress thread's collectives go on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static Py_ssize_t encoded_bytes(Py_ssize_t n, int bits, Py_ssize_t block) {
    return 4 * ((n + block - 1) / block) + (n * bits + 7) / 8;
}

/* codes packed into a bit stream, least significant bit first */
typedef struct {
    uint8_t *out;
    uint64_t acc;
    int have;
} bitwriter;

static inline void put(bitwriter *w, uint32_t code, int bits) {
    w->acc |= (uint64_t)code << w->have;
    w->have += bits;
    while (w->have >= 8) {
        *w->out++ = (uint8_t)w->acc;
        w->acc >>= 8;
        w->have -= 8;
    }
}

/* rint(v) for |v| <= 2**22 or non-finite v, without a call into libm: the x86-64 baseline has no
 * rounding instruction, so rintf is a call per element, which keeps the loop from being vectorised
 * (30 ms for 6.1M elements in int8 with it, 7.8 ms with this and the branch-free loops). Adding and
 * subtracting 1.5 * 2**23 rounds to nearest even in the default rounding mode; copysign keeps
 * rint's sign of a zero (rint(-0.3) is -0.0). The quotients here are at most 1.5 q in magnitude
 * (q where the scale is a normal float; a subnormal scale rounds by up to half a unit). */
static inline float round_even(float v) {
    const float magic = 12582912.0f;
    return copysignf((v + magic) - magic, v);
}

#define SUB 256 /* elements per pass of the vectorised loops: the temporaries stay in L1 */

/* the codes of one run of a block: r clipped to [-q, q] (a NaN read as 0, so that no NaN is cast
 * to an integer; its block's scale is NaN, so its decoded value is NaN as the reference's), the
 * decoded values r * s, the codes r + q. Branch-free loops that the compiler vectorises. */
static void quantise_run(const float *x, Py_ssize_t len, float safe, float s, float q, int iq, float *dec,
                         uint8_t *codes) {
    float r[SUB];
    for (Py_ssize_t i = 0; i < len; i++) {
        float v = round_even(x[i] / safe);
        v = v > q ? q : v;
        v = v < -q ? -q : v;
        r[i] = v == v ? v : 0.0f;
    }
    if (dec)
        for (Py_ssize_t i = 0; i < len; i++) dec[i] = r[i] * s;
    for (Py_ssize_t i = 0; i < len; i++) codes[i] = (uint8_t)((int)r[i] + iq);
}

/* max |x| over a block, NaN if any element is NaN (numpy's and torch's max propagate it) */
static float block_absmax(const float *x, Py_ssize_t len) {
    float m = 0.0f;
    int nan = 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
        nan |= a != a;
    }
    return nan ? NAN : m;
}

static void encode_run(const float *x, Py_ssize_t n, int bits, Py_ssize_t block, uint8_t *out, float *dec) {
    const float q = (float)((1 << (bits - 1)) - 1);
    const int iq = (1 << (bits - 1)) - 1;
    Py_ssize_t nb = (n + block - 1) / block;
    uint8_t *scales = out;
    bitwriter w = {out + 4 * nb, 0, 0};
    uint8_t codes[SUB];
    for (Py_ssize_t b = 0; b < nb; b++) {
        Py_ssize_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float s = block_absmax(x + lo, hi - lo) / q;
        float safe = s > 0.0f ? s : 1.0f;
        memcpy(scales + 4 * b, &s, 4);
        for (Py_ssize_t at = lo; at < hi; at += SUB) {
            Py_ssize_t len = hi - at < SUB ? hi - at : SUB;
            if (bits == 8) { /* the codes are the bytes */
                quantise_run(x + at, len, safe, s, q, iq, dec ? dec + at : NULL, w.out);
                w.out += len;
                continue;
            }
            quantise_run(x + at, len, safe, s, q, iq, dec ? dec + at : NULL, codes);
            Py_ssize_t i = 0;
            if (w.have == 0 && (bits == 4 || bits == 2)) { /* byte-aligned: whole codes per byte */
                int per = 8 / bits;
                for (; i + per <= len; i += per) {
                    uint8_t byte = 0;
                    for (int j = 0; j < per; j++) byte |= (uint8_t)(codes[i + j] << (bits * j));
                    *w.out++ = byte;
                }
            }
            for (; i < len; i++) put(&w, codes[i], bits);
        }
    }
    if (w.have > 0) *w.out++ = (uint8_t)w.acc; /* the last byte, zero-padded */
}

/* out[i] = (codes[i] - q) * s, or out[i] += that: a branch-free loop the compiler vectorises */
static void dequantise_run(const uint8_t *codes, Py_ssize_t len, float s, int iq, float *out, int accumulate) {
    if (accumulate)
        for (Py_ssize_t i = 0; i < len; i++) out[i] = out[i] + (float)((int)codes[i] - iq) * s;
    else
        for (Py_ssize_t i = 0; i < len; i++) out[i] = (float)((int)codes[i] - iq) * s;
}

static void decode_run(const uint8_t *buf, Py_ssize_t n, int bits, Py_ssize_t block, float *out, int accumulate) {
    const int iq = (1 << (bits - 1)) - 1;
    const uint32_t mask = (1u << bits) - 1u;
    Py_ssize_t nb = (n + block - 1) / block;
    const uint8_t *in = buf + 4 * nb;
    uint8_t codes[SUB];
    uint64_t acc = 0;
    int have = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        Py_ssize_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float s;
        memcpy(&s, buf + 4 * b, 4);
        for (Py_ssize_t at = lo; at < hi; at += SUB) {
            Py_ssize_t len = hi - at < SUB ? hi - at : SUB;
            if (bits == 8) {
                dequantise_run(in + at, len, s, iq, out + at, accumulate);
                continue;
            }
            for (Py_ssize_t i = 0; i < len; i++) { /* the bit stream, least significant bit first */
                while (have < bits) {
                    acc |= (uint64_t)(*in++) << have;
                    have += 8;
                }
                codes[i] = (uint8_t)(acc & mask);
                acc >>= bits;
                have -= bits;
            }
            dequantise_run(codes, len, s, iq, out + at, accumulate);
        }
    }
}

static int check_args(int bits, Py_ssize_t block, Py_ssize_t n) {
    if (bits < 2 || bits > 8 || block < 1 || n < 0) {
        PyErr_Format(PyExc_ValueError, "quantise: bits must be 2..8 and block >= 1, got bits=%d block=%zd n=%zd",
                     bits, block, n);
        return 0;
    }
    return 1;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer x, out, dec = {0};
    int bits;
    Py_ssize_t block;
    PyObject *dec_obj;
    if (!PyArg_ParseTuple(args, "y*inw*O", &x, &bits, &block, &out, &dec_obj)) return NULL;
    PyObject *res = NULL;
    int have_dec = dec_obj != Py_None;
    if (have_dec && PyObject_GetBuffer(dec_obj, &dec, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done_x;
    Py_ssize_t n = x.len / 4;
    if (!check_args(bits, block, n)) goto done;
    if (x.len % 4 || out.len != encoded_bytes(n, bits, block) || (have_dec && dec.len != x.len)) {
        PyErr_Format(PyExc_ValueError, "quantise encode: x has %zd bytes, out %zd (expected %zd), dec %zd",
                     x.len, out.len, encoded_bytes(n, bits, block), have_dec ? dec.len : (Py_ssize_t)-1);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    encode_run((const float *)x.buf, n, bits, block, (uint8_t *)out.buf, have_dec ? (float *)dec.buf : NULL);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    if (have_dec) PyBuffer_Release(&dec);
done_x:
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return res;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf, out;
    Py_ssize_t n, block;
    int bits, accumulate;
    if (!PyArg_ParseTuple(args, "y*ninw*p", &buf, &n, &bits, &block, &out, &accumulate)) return NULL;
    PyObject *res = NULL;
    if (!check_args(bits, block, n)) goto done;
    if (buf.len != encoded_bytes(n, bits, block) || out.len != 4 * n) {
        PyErr_Format(PyExc_ValueError, "quantise decode: %zd elements need %zd bytes in and %zd out, got %zd and %zd",
                     n, encoded_bytes(n, bits, block), 4 * n, buf.len, out.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_run((const uint8_t *)buf.buf, n, bits, block, (float *)out.buf, accumulate);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&out);
    return res;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(x, bits, block, out, dec): float32 x into out (scales, then packed codes); decoded values into dec "
     "(or None)"},
    {"decode", decode, METH_VARARGS,
     "decode(buf, n, bits, block, out, accumulate): the n float32 values of buf into out (out += them if "
     "accumulate)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hvd_commopt.compress._quantkernels",
                                    "The low-bit quantiser's host kernels (docs/quantize.md#native).", -1, methods};

PyMODINIT_FUNC PyInit__quantkernels(void) { return PyModule_Create(&module); }
