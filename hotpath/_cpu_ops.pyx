# cython: language_level=3
"""RMSNorm, rotary embedding and the int8 rescale on the CPU, one call each instead of a chain of torch ops.

A decode step of a small model spends more time dispatching its elementwise torch ops than
computing them (RMSNorm is ~6 ops, rotary embedding ~8, each a few microseconds however small
the tensor). These kernels do the same arithmetic in one pass over float32 rows, in the order the
torch formulas round it (`-ffp-contract=off`: no fused multiply-adds):

    rms_norm   out = weight * (x * (1 / sqrt(mean(x^2) + eps)))      x, out [rows, dim]
    rope       out = x * cos + rotate_half(x) * sin                    x [T, H, D] (rows strided), out [T, H, D]

    int8_rescale  out = (float)acc * (xs[r] * ws[c])  (+ bias[c])       acc [rows, cols] int32

The rotary result equals torch's bit for bit, and so does the rescale (its float32 product
rounded to bf16 to nearest even, then the bias added and rounded again, as torch's two ops do); RMSNorm's mean sums in 8 lanes, so it may differ
from torch's reduction in the last bit. Their pure-torch twins are `sloserve.layers.norm` and
`sloserve.layers.rope` (SLOSERVE_NO_EXTENSIONS=1, any other device or dtype, or torch.compile).
Callers check dtypes, shapes and contiguity; arguments here are data pointers.
"""

from libc.math cimport sqrtf
from libc.stdint cimport int32_t, uint16_t, uint32_t, uintptr_t
from libc.string cimport memcpy


cdef enum:
    _LANES = 8


def rms_norm(uintptr_t x, uintptr_t weight, uintptr_t out, Py_ssize_t rows, Py_ssize_t dim, float eps):
    """out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for each of `rows` contiguous rows of `dim`."""
    cdef const float* xp = <const float*> x
    cdef const float* wp = <const float*> weight
    cdef float* op = <float*> out
    cdef Py_ssize_t r, d, j, width
    cdef float acc[_LANES]
    cdef float inv
    cdef const float* row
    cdef float* dst
    if rows <= 0 or dim <= 0:
        return
    with nogil:
        for r in range(rows):
            row = xp + r * dim
            dst = op + r * dim
            for j in range(_LANES):
                acc[j] = 0.0
            d = 0
            while d + _LANES <= dim:
                for j in range(_LANES):
                    acc[j] += row[d + j] * row[d + j]
                d += _LANES
            while d < dim:
                acc[0] += row[d] * row[d]
                d += 1
            width = _LANES // 2
            while width > 0:
                for j in range(width):
                    acc[j] += acc[j + width]
                width //= 2
            inv = (<float> 1.0) / sqrtf(acc[0] / dim + eps)
            for d in range(dim):
                dst[d] = wp[d] * (row[d] * inv)


def rope(uintptr_t x, Py_ssize_t row_stride, uintptr_t cos, uintptr_t sin, uintptr_t out, Py_ssize_t tokens,
         Py_ssize_t heads, Py_ssize_t dim):
    """out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t].

    x: token t's heads start at x + t * row_stride, each `dim` contiguous floats after the
    other; cos, sin: [tokens, dim] contiguous; out: [tokens, heads, dim] contiguous.
    rotate_half(v) = (-v[half:], v[:half]).
    """
    cdef const float* xp = <const float*> x
    cdef const float* cp = <const float*> cos
    cdef const float* sp = <const float*> sin
    cdef float* op = <float*> out
    cdef Py_ssize_t t, h, d, half = dim // 2
    cdef const float* v
    cdef const float* c
    cdef const float* s
    cdef float* dst
    cdef float a, b
    if tokens <= 0 or heads <= 0 or dim <= 0:
        return
    with nogil:
        for t in range(tokens):
            c = cp + t * dim
            s = sp + t * dim
            for h in range(heads):
                v = xp + t * row_stride + h * dim
                dst = op + (t * heads + h) * dim
                for d in range(half):
                    a = v[d] * c[d]
                    b = (-v[d + half]) * s[d]
                    dst[d] = a + b
                for d in range(half, dim):
                    a = v[d] * c[d]
                    b = v[d - half] * s[d]
                    dst[d] = a + b


cdef inline uint16_t _bf16(float value) noexcept nogil:
    """value rounded to bf16, to nearest even (NaN to torch's quiet NaN), as c10::BFloat16 does."""
    cdef uint32_t bits
    memcpy(&bits, &value, 4)
    if (bits & 0x7fffffff) > 0x7f800000:
        return 0x7fc0
    return <uint16_t> ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16)


cdef inline float _float(uint16_t value) noexcept nogil:
    cdef uint32_t bits = (<uint32_t> value) << 16
    cdef float out
    memcpy(&out, &bits, 4)
    return out


def int8_rescale(uintptr_t acc, uintptr_t xs, uintptr_t ws, uintptr_t bias, uintptr_t out,
                 Py_ssize_t rows, Py_ssize_t cols, bint bf16):
    """out[r, c] = (float)acc[r, c] * (xs[r] * ws[c]), then + bias[c] when bias is not 0.

    acc: [rows, cols] int32 (an int8 product's sums); xs [rows], ws [cols]: float32 scales; out and
    bias: [rows, cols] and [cols] of bf16 (bf16 true) or float32. In one pass: torch's
    `(acc * (xs[:, None] * ws)).to(dtype) + bias` makes three temporaries of the product's size.
    """
    cdef const int32_t* ap = <const int32_t*> acc
    cdef const float* xp = <const float*> xs
    cdef const float* wp = <const float*> ws
    cdef const float* fbias = <const float*> bias
    cdef const uint16_t* hbias = <const uint16_t*> bias
    cdef float* fout = <float*> out
    cdef uint16_t* hout = <uint16_t*> out
    cdef Py_ssize_t r, c
    cdef float s, v
    cdef const int32_t* row
    if rows <= 0 or cols <= 0:
        return
    with nogil:
        for r in range(rows):
            s = xp[r]
            row = ap + r * cols
            if bf16 and bias:
                for c in range(cols):
                    v = (<float> row[c]) * (s * wp[c])
                    hout[r * cols + c] = _bf16(_float(_bf16(v)) + _float(hbias[c]))
            elif bf16:
                for c in range(cols):
                    v = (<float> row[c]) * (s * wp[c])
                    hout[r * cols + c] = _bf16(v)
            elif bias:
                for c in range(cols):
                    v = (<float> row[c]) * (s * wp[c])
                    fout[r * cols + c] = v + fbias[c]
            else:
                for c in range(cols):
                    fout[r * cols + c] = (<float> row[c]) * (s * wp[c])
