# cython: language_level=3
# distutils: extra_compile_args = -pthread
# distutils: extra_link_args = -pthread
# distutils: include_dirs = hotpath
"""A dense decoder's whole decode step in one nogil call (the C is in `_decode_step.h`).

`DecodeKernel` holds the model's weight and cache addresses, set once, and its team of threads
(`_team.h`, started at the first call that asks for more than one); each call passes the step's
input addresses and writes the logits. Its pure-torch twin is `DecoderModel.decode`;
`sloserve.executor.fused` checks shapes, dtypes and contiguity and keeps the tensors alive.
"""

from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.stdlib cimport free, malloc, realloc


cdef extern from "_decode_step.h" nogil:
    enum: SLOSERVE_MAX_BATCH

    enum: SLOSERVE_F32
    enum: SLOSERVE_BF16
    enum: SLOSERVE_I8
    enum: SLOSERVE_I4

    ctypedef struct sloserve_weight:
        const void* data
        const float* scale
        const int32_t* rowsum
        int type
        const void* scales_zeros
        Py_ssize_t rows
        int group, scale_bf16

    ctypedef struct sloserve_layer:
        const float* ln1
        const float* ln2
        sloserve_weight qkv_w
        const float* qkv_b
        sloserve_weight o_w
        const float* o_b
        sloserve_weight gate_up_w
        const float* gate_up_b
        sloserve_weight down_w
        const float* down_b
        void* k_cache
        void* v_cache

    ctypedef struct sloserve_decoder:
        Py_ssize_t hidden, heads, kv_heads, head_dim, inter, vocab, num_layers, page, num_pages
        float eps, scale
        int kv_type
        sloserve_weight embed
        const float* norm
        sloserve_weight lm_head
        const float* cos
        const float* sin
        const sloserve_layer* layers

    ctypedef struct sloserve_team:
        int size

    sloserve_team* sloserve_team_start(int size)
    void sloserve_team_stop(sloserve_team* team)
    Py_ssize_t sloserve_decode_workspace(const sloserve_decoder* m, Py_ssize_t batch, Py_ssize_t max_len,
                                         int threads)
    int sloserve_decode_step(const sloserve_decoder* m, const int64_t* ids, const int64_t* positions,
                             const int64_t* slots, const int32_t* tables, Py_ssize_t width, const int32_t* lens,
                             Py_ssize_t batch, Py_ssize_t max_len, const int64_t* out_rows, Py_ssize_t num_out,
                             sloserve_team* team, float* work, float* logits, long* stalled_ns)
    int sloserve_dpbf16_set(int on)
    int sloserve_dpbf16_enabled
    int sloserve_vnni_set(int on)
    int sloserve_vnni_enabled
    int sloserve_int4_set(int on)
    int sloserve_int4_avx512


# bf16 products on AVX512-BF16 dot products wherever the CPU has them (_decode_step_dpbf16.h).
sloserve_dpbf16_set(1)
# int8 products on AVX512-VNNI wherever the CPU has it (_decode_step_int8.h).
sloserve_vnni_set(1)
# int4 products on AVX-512 wherever the CPU has it (_decode_step_int4.h).
sloserve_int4_set(1)


def bf16_dot_products(enabled: bool | None = None) -> bool:
    """Whether bf16 products run on AVX512-BF16 dot products (activations rounded to bf16): False
    forces the widened float32 path (tests compare the two), True restores the dot products where
    the CPU has them, None only asks. Set between steps, never while one runs."""
    if enabled is not None:
        sloserve_dpbf16_set(1 if enabled else 0)
    return bool(sloserve_dpbf16_enabled)


def int8_vnni(enabled: bool | None = None) -> bool:
    """Whether int8 products run on AVX512-VNNI: False forces the widened int32 loop (the same
    bits: the sums are exact), True restores VNNI where the CPU has it, None only asks. Set
    between steps, never while one runs."""
    if enabled is not None:
        sloserve_vnni_set(1 if enabled else 0)
    return bool(sloserve_vnni_enabled)


def int4_avx512(enabled: bool | None = None) -> bool:
    """Whether int4 products run on AVX-512: False forces the scalar loop (tests compare the two),
    True restores AVX-512 where the CPU has it, None only asks. Set between steps, never while
    one runs."""
    if enabled is not None:
        sloserve_int4_set(1 if enabled else 0)
    return bool(sloserve_int4_avx512)


# The element types the kernel reads weights and KV pages in, by torch's name for them (int8 KV
# pages: rows of int8 values, each followed by its bf16 scale; sloserve/layers/attention/kv_int8.py).
_TYPES = {"float32": SLOSERVE_F32, "bfloat16": SLOSERVE_BF16}
_KV_TYPES = {**_TYPES, "int8": SLOSERVE_I8}


cdef const float* _ptr(object address):
    return <const float*> <uintptr_t> (0 if address is None else address)


cdef int _type(str name, dict types=_TYPES, str what="weights") except -1:
    if name not in types:
        raise ValueError(f"the kernel reads {' or '.join(types)} {what}, not {name}")
    return types[name]


cdef sloserve_weight _weight(object address, int kind):
    cdef sloserve_weight w
    w.data, w.scale, w.rowsum, w.type = <const void*> _ptr(address), NULL, NULL, kind
    w.scales_zeros, w.rows, w.group, w.scale_bf16 = NULL, 0, 0, 0
    return w


cdef sloserve_weight _projection(dict layer, str name, int kind) except *:
    """Projection `name` of a layer dict: int8 when the dict gives its scale and row sums, int4
    when it gives its scales_zeros, rows, group and scale dtype (_decode_step_int4.h)."""
    cdef sloserve_weight w = _weight(layer[name + "_w"], kind)
    if layer.get(name + "_group") is not None:
        w.scales_zeros = <const void*> _ptr(layer[name + "_scales_zeros"])
        w.rows, w.group = layer[name + "_rows"], layer[name + "_group"]
        w.scale_bf16 = _type(layer[name + "_scale_dtype"]) == SLOSERVE_BF16
        if w.rows % 64 or w.group <= 0 or w.scales_zeros == NULL:
            raise ValueError(f"int4 projection {name}: {w.rows} rows (a multiple of 64), group {w.group}")
        w.type = SLOSERVE_I4
        return w
    if layer.get(name + "_scale") is not None:
        if layer.get(name + "_rowsum") is None:
            raise ValueError(f"int8 projection {name} needs {name}_rowsum beside {name}_scale")
        w.scale = _ptr(layer[name + "_scale"])
        w.rowsum = <const int32_t*> <uintptr_t> layer[name + "_rowsum"]
        w.type = SLOSERVE_I8
    return w


cdef class DecodeKernel:
    """The decode step of one model: `dims` are its shapes, `layers` one dict of addresses each."""

    cdef sloserve_decoder model
    cdef sloserve_layer* layers
    cdef sloserve_team* team
    cdef float* work
    cdef Py_ssize_t work_floats
    cdef Py_ssize_t max_positions
    cdef bint busy

    def __init__(self, dict dims, uintptr_t embed, uintptr_t norm, uintptr_t lm_head, uintptr_t cos, uintptr_t sin,
                 list layers, dict int8_head=None):
        """dims: hidden, heads, kv_heads, head_dim, inter, vocab, page, num_pages, max_positions, eps,
        scale, and weight_dtype ("float32" or "bfloat16": of the weight matrices embed, lm_head and
        each layer's *_w) and kv_dtype (those, or "int8": of the KV pages); norms, biases, cos and
        sin are float32.
        layers: dicts of ln1, ln2, qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b, down_w, down_b,
        k_cache, v_cache (addresses; a missing bias is None); a projection of int8 rows also
        gives <name>_scale (float32 per row) and <name>_rowsum (int32: the sum of each row's
        weights), its products then W8A8 as layers/quant.py computes them; one in torch's CPU int4
        layout gives <name>_scales_zeros, <name>_rows, <name>_group and <name>_scale_dtype
        (float32 or bfloat16), its products then W4A16 (_decode_step_int4.h). int8_head: the int8
        embedding's and LM head's addresses beside theirs, embed_scale (its rows then int8, read
        as Int8Linear.lookup reads them), lm_head_scale and lm_head_rowsum (as a projection's)."""
        cdef Py_ssize_t i
        cdef int wtype = _type(dims.get("weight_dtype", "float32"))
        cdef int kvtype = _type(dims.get("kv_dtype", "float32"), _KV_TYPES, "KV pages")
        if self.layers != NULL:
            raise RuntimeError("DecodeKernel is set once")
        for key in ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "page", "num_pages", "max_positions"):
            if int(dims[key]) <= 0:
                raise ValueError(f"{key} must be positive, got {dims[key]}")
        if dims["heads"] % dims["kv_heads"] or dims["head_dim"] % 2:
            raise ValueError(f"{dims['heads']} query heads need a multiple of {dims['kv_heads']} KV heads, "
                             f"and head_dim {dims['head_dim']} must be even")
        if not layers:
            raise ValueError("a decoder has at least one layer")
        self.layers = <sloserve_layer*> malloc(len(layers) * sizeof(sloserve_layer))
        if self.layers == NULL:
            raise MemoryError()
        for i, layer in enumerate(layers):
            self.layers[i].ln1 = _ptr(layer["ln1"])
            self.layers[i].ln2 = _ptr(layer["ln2"])
            self.layers[i].qkv_w = _projection(layer, "qkv", wtype)
            self.layers[i].qkv_b = _ptr(layer["qkv_b"])
            self.layers[i].o_w = _projection(layer, "o", wtype)
            self.layers[i].o_b = _ptr(layer["o_b"])
            self.layers[i].gate_up_w = _projection(layer, "gate_up", wtype)
            self.layers[i].gate_up_b = _ptr(layer["gate_up_b"])
            self.layers[i].down_w = _projection(layer, "down", wtype)
            self.layers[i].down_b = _ptr(layer["down_b"])
            self.layers[i].k_cache = <void*> _ptr(layer["k_cache"])
            self.layers[i].v_cache = <void*> _ptr(layer["v_cache"])
        m = &self.model
        m.hidden, m.heads, m.kv_heads = dims["hidden"], dims["heads"], dims["kv_heads"]
        m.head_dim, m.inter, m.vocab = dims["head_dim"], dims["inter"], dims["vocab"]
        m.num_layers, m.page, m.num_pages = len(layers), dims["page"], dims["num_pages"]
        m.eps, m.scale = dims["eps"], dims["scale"]
        m.embed, m.norm, m.lm_head = _weight(embed, wtype), _ptr(norm), _weight(lm_head, wtype)
        if int8_head:
            if int8_head.get("embed_scale") is not None:
                m.embed.scale, m.embed.type = _ptr(int8_head["embed_scale"]), SLOSERVE_I8
            m.lm_head = _projection({"lm_head_w": lm_head, **int8_head}, "lm_head", wtype)
        m.kv_type = kvtype
        m.cos, m.sin = _ptr(cos), _ptr(sin)
        m.layers = self.layers
        self.max_positions = dims["max_positions"]

    def __dealloc__(self):
        sloserve_team_stop(self.team)
        free(self.layers)
        free(self.work)

    cdef int _team_size(self, int num_threads) except -1:
        """Start (or restart with another size) the team of `num_threads` threads: its size."""
        if num_threads <= 1:
            return 1
        if self.team != NULL and self.team.size == num_threads:
            return num_threads
        sloserve_team_stop(self.team)
        self.team = sloserve_team_start(num_threads)
        if self.team == NULL:
            raise RuntimeError(f"DecodeKernel: cannot start {num_threads} threads")
        return num_threads

    def __call__(self, uintptr_t input_ids, uintptr_t positions, uintptr_t slots, uintptr_t block_tables,
                 Py_ssize_t table_width, uintptr_t seq_lens, Py_ssize_t batch, uintptr_t logits, int num_threads,
                 uintptr_t logit_rows=0, Py_ssize_t num_logit_rows=-1):
        """logits[batch, V] of one step of `batch` rows, one query token each (input ids, positions,
        slots int64; tables, lengths int32). With num_logit_rows >= 0, logits[num_logit_rows, V] of the
        rows `logit_rows` names (int64 row indices; none at 0: the step only writes K and V). Rows may be one sequence's
        consecutive tokens (see _decode_step.h).

        Returns the nanoseconds the calling thread spent waiting for late team threads (0 on one
        thread): a measure of how much other processes held this step's threads off their cores.

        ValueError when a token id, KV slot, length or logit row is out of range, a position is not
        length - 1, or a block table names a page outside the pool (then the logits are undefined).
        """
        cdef const int64_t* pos = <const int64_t*> positions
        cdef const int32_t* lens = <const int32_t*> seq_lens
        cdef const int64_t* ids = <const int64_t*> input_ids
        cdef const int64_t* slot = <const int64_t*> slots
        cdef const int64_t* out_rows = NULL
        cdef int64_t no_rows = 0
        cdef Py_ssize_t b, need, longest = 1
        cdef int rc, threads
        cdef long stalled_ns = 0
        cdef float* grown
        if self.layers == NULL:
            raise RuntimeError("DecodeKernel was never set")
        if batch <= 0:
            return 0
        if batch > SLOSERVE_MAX_BATCH:
            raise ValueError(f"{batch} rows exceed the kernel's {SLOSERVE_MAX_BATCH} per step")
        if self.busy:
            raise RuntimeError("DecodeKernel is not reentrant: one step at a time")
        num_threads = max(1, num_threads)
        for b in range(batch):
            if lens[b] < 1 or lens[b] > table_width * self.model.page or pos[b] != lens[b] - 1 \
                    or pos[b] >= self.max_positions:
                raise ValueError(f"sequence {b}: length {lens[b]} at position {pos[b]} is outside 1.."
                                 f"{min(table_width * self.model.page, self.max_positions)} or not position + 1")
            if ids[b] < 0 or ids[b] >= self.model.vocab:
                raise ValueError(f"sequence {b}: token id {ids[b]} is outside [0, {self.model.vocab})")
            if slot[b] < 0 or slot[b] >= self.model.num_pages * self.model.page:
                raise ValueError(f"sequence {b}: KV slot {slot[b]} is outside the pool's "
                                 f"{self.model.num_pages * self.model.page}")
            longest = max(longest, lens[b])
        if num_logit_rows >= 0:
            if num_logit_rows > batch or (num_logit_rows and not logit_rows):
                raise ValueError(f"{num_logit_rows} logit rows at {logit_rows:#x} for a step of {batch} rows")
            out_rows = <const int64_t*> logit_rows if num_logit_rows else &no_rows
            for b in range(num_logit_rows):
                if out_rows[b] < 0 or out_rows[b] >= batch:
                    raise ValueError(f"logit row {out_rows[b]} is outside the step's {batch} rows")
        threads = self._team_size(num_threads)
        need = sloserve_decode_workspace(&self.model, batch, longest, threads)
        if need > self.work_floats:
            grown = <float*> realloc(self.work, need * sizeof(float))
            if grown == NULL:
                raise MemoryError("DecodeKernel: cannot grow the workspace")
            self.work, self.work_floats = grown, need
        self.busy = True
        try:
            with nogil:
                rc = sloserve_decode_step(&self.model, ids, pos, slot,
                                          <const int32_t*> block_tables, table_width, lens, batch, longest,
                                          out_rows, num_logit_rows, self.team if threads > 1 else NULL, self.work, <float*> logits,
                                          &stalled_ns)
        finally:
            self.busy = False
        if rc:
            raise ValueError(f"a block table names a page outside [0, {self.model.num_pages})")
        return stalled_ns
