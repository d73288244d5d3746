"""The Triton kernels of ``scaleopt._triton`` (imported at their first launch).

Every kernel but ``totals`` runs one program per (tensor, chunk) pair: ``chunks[pid]`` is (k,
where the chunk starts, its slot for partial sums), row k of ``ptrs`` holds the tensor's
addresses (w, m, v, w16), its place i in the group, and for stored moments the addresses of
the int8 scales of m and v, the length of a row of blocks and where the local piece starts in
the whole tensor; ``sizes[k]`` its size; ``grads[i]`` the address of its gradient (a table of
its own: a step's gradients may be elsewhere than the last step's). Row i of ``scal``: lr,
weight decay, adapt, gradient multiplier, the bias corrections 1 - beta1^t and
sqrt(1 - beta2^t) of its step, and the step t. The phases are the C kernels'
(``csrc/``), each operation rounded once (compiled without contraction, with ``div_rn`` and
``sqrt_rn``). Every phase multiplies by the bias corrections' reciprocals, rounded once per
program, as the C kernels do (the reference loop divides: two divisions more per element);
1 - beta1 and 1 - beta2 come from the host, rounded once from float64 as the reference
rounds them.
Kinds (compile-time, their codes ``_format``'s): ``W_SPLIT`` a split master (the weight's
bfloat16 upper halves at w, the int16 lower halves at w16) or a float32 weight; ``G_KIND`` the
gradient's dtype (``GRAD_KINDS``); ``W16_KIND`` what w16 holds (``W16_KINDS``: nothing, the
rounded bfloat16 / float16 weights to write, a split master's lower halves); ``FORM`` how the
moments are stored (``MOMENT_FORMS``: float32, bfloat16, int8 codes: ``_compact``); ``MODE``
LAMB's weight-decay mode (``WEIGHT_DECAY_MODES``); ``ALIGNED`` every address of the launch a
multiple of 16 bytes and every size (int8: row length) a multiple of 16 elements, so that the
loads and stores may be 128-bit vectors, and ``_WHOLE_BLOCKS`` (2) where int8 rows are
moreover whole blocks of 256 (``_triton._aligned`` decides it per tensor and step).

A chunk of float32 or bfloat16 moments is ``ITERS`` runs of ``BLOCK`` elements from its first
element. A chunk of int8 moments is ``ITERS`` tiles of ``QB`` whole blocks of 256 (a block's
largest magnitude is its scale), from its first block: a tile's rows are blocks, so the scales
are reductions along them and a block never spans two programs.

The sums phases write each chunk's partial sums to its own slot; ``totals`` adds up each
tensor's in a fixed order. A line marked ``# estimate:`` holds the one approximate operation,
which an exact step corrects (``tools/triton_compile.py`` allows no other).
"""

import triton
import triton.language as tl

from . import _format
from ._triton_layout import ADAM, CHUNKS, PTRS, SCAL, VECTOR, WHOLE_BLOCKS

_ROW = tl.constexpr(len(PTRS))  # int64 entries per row of ``ptrs``
_SCAL = tl.constexpr(len(SCAL))  # float32 entries per row of ``scal``
_CHUNK = tl.constexpr(len(CHUNKS))  # int64 entries per row of ``chunks``
# the columns of a row of ``ptrs`` (``_triton_layout``)
_W, _M, _V, _W16, _INDEX, _M_SCALE, _V_SCALE, _ROW_LEN, _OFFSET = map(
    tl.constexpr, range(len(PTRS)))
# of the step table
_LR, _WD, _ADAPT, _GRAD_MULT, _BC1, _BC2, _T = map(tl.constexpr, range(len(SCAL)))
# of Adam's step table
_ADAM = tl.constexpr(len(ADAM))
(_A_STEP_SIZE, _A_BC2, _A_INV_BC2, _A_WD_L2, _A_DECAY, _A_GRAD_MULT,
 _A_T) = map(tl.constexpr, range(len(ADAM)))
# of ``chunks``
_TENSOR, _START, _SLOT = map(tl.constexpr, range(len(CHUNKS)))
_VECTOR = tl.constexpr(VECTOR)  # ALIGNED's bytes of an address, elements of a size
_WHOLE_BLOCKS = tl.constexpr(WHOLE_BLOCKS)  # ALIGNED where int8 rows are whole blocks
_BIG = tl.constexpr(3.4028234663852886e38)  # the largest float32: a ratio above it is not finite
# the compact format's constants (``_format``)
_SIGNED_SCALE = tl.constexpr(_format.SIGNED_SCALE)
_ROOT_OFFSET = tl.constexpr(_format.ROOT_OFFSET)
_UNSIGNED_SCALE = tl.constexpr(_format.UNSIGNED_SCALE)
_CODE_OFFSET = tl.constexpr(_format.CODE_OFFSET)
_CODE_SHIFT = tl.constexpr(_format.CODE_SHIFT)
_CODE_LOW = tl.constexpr(_format.CODE_LOW)  # F(0), the offset of the unsigned codes
_HASH_MUL = tl.constexpr(_format.HASH_MUL)
_STEP_MUL = tl.constexpr(_format.STEP_MUL)
_M_SALT = tl.constexpr(_format.salt_key("exp_avg"))  # salt * SALT_MUL, in 32 bits
_V_SALT = tl.constexpr(_format.salt_key("exp_avg_sq"))
# the kinds' and modes' codes (``_format``)
_G_BFLOAT16 = tl.constexpr(_format.GRAD_KINDS["bfloat16"])
_G_FLOAT16 = tl.constexpr(_format.GRAD_KINDS["float16"])
_W16_BFLOAT16 = tl.constexpr(_format.W16_KINDS["bfloat16"])
_W16_FLOAT16 = tl.constexpr(_format.W16_KINDS["float16"])
_FORM_FLOAT32 = tl.constexpr(_format.MOMENT_FORMS["float32"])
_FORM_BFLOAT16 = tl.constexpr(_format.MOMENT_FORMS["bfloat16"])
_FORM_INT8 = tl.constexpr(_format.MOMENT_FORMS["int8"])
_MODE_UPDATE = tl.constexpr(_format.WEIGHT_DECAY_MODES["update"])
_MODE_DECOUPLED = tl.constexpr(_format.WEIGHT_DECAY_MODES["decoupled"])
_MODE_L2 = tl.constexpr(_format.WEIGHT_DECAY_MODES["l2"])


@triton.jit
def _at(address, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """An address read from a table as a pointer to ``dtype``: known to be a multiple of 16
    bytes where ALIGNED (so that the compiler may move 16 bytes per load or store)."""
    p = address.to(tl.pointer_type(dtype))
    if ALIGNED:
        p = tl.multiple_of(p, _VECTOR)
    return p


@triton.jit
def _pointers(row, grads, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr, W16_KIND: tl.constexpr,
              FORM: tl.constexpr, ALIGNED: tl.constexpr):
    wp = _at(tl.load(row + _W), tl.int16 if W_SPLIT else tl.float32, ALIGNED)
    g = tl.load(grads + tl.load(row + _INDEX))  # the gradients' addresses: a table of the step's
    if G_KIND == _G_BFLOAT16:
        gp = _at(g, tl.bfloat16, ALIGNED)
    elif G_KIND == _G_FLOAT16:
        gp = _at(g, tl.float16, ALIGNED)
    else:
        gp = _at(g, tl.float32, ALIGNED)
    if FORM == _FORM_BFLOAT16:
        mp = _at(tl.load(row + _M), tl.uint16, ALIGNED)
        vp = _at(tl.load(row + _V), tl.uint16, ALIGNED)
    elif FORM == _FORM_INT8:
        mp = _at(tl.load(row + _M), tl.int8, ALIGNED)
        vp = _at(tl.load(row + _V), tl.uint8, ALIGNED)
    else:
        mp = _at(tl.load(row + _M), tl.float32, ALIGNED)
        vp = _at(tl.load(row + _V), tl.float32, ALIGNED)
    if W16_KIND == _W16_BFLOAT16:
        w16p = _at(tl.load(row + _W16), tl.bfloat16, ALIGNED)
    elif W16_KIND == _W16_FLOAT16:
        w16p = _at(tl.load(row + _W16), tl.float16, ALIGNED)
    else:
        w16p = _at(tl.load(row + _W16), tl.int16, ALIGNED)
    return wp, gp, mp, vp, w16p


@triton.jit
def _blocks(row, n, start, QB: tl.constexpr, FORM: tl.constexpr, ALIGNED: tl.constexpr):
    """What a program's iterations share of where its elements lie. For int8 moments: the
    tensor's blocks and the chunk's first block; where rows are not whole blocks (ALIGNED
    below ``_WHOLE_BLOCKS``; a block is 256 elements of a row, the last of a row shorter):
    where the last row starts, the row length, the blocks per row, the chunk's first block,
    the row and column of each lane j < QB's block in the first tile, the rows and columns a
    tile further on adds, and the length of a row's last block (so that a program divides
    once, in its first tile, and its later tiles only add). Blocks number fewer than 2^31 (a
    tensor's size: 2^39): int32 holds them. ALIGNED 1: the rows' lengths are multiples of 16
    elements (the mask then changes only between runs of 16). For other forms: the size and
    the first element."""
    if FORM == _FORM_INT8 and ALIGNED == _WHOLE_BLOCKS:
        return (n // 256).to(tl.int32), tl.cast(start, tl.int32)
    elif FORM == _FORM_INT8:
        row_len = tl.maximum(tl.load(row + _ROW_LEN), 1)
        if ALIGNED:
            row_len = tl.multiple_of(row_len, _VECTOR)
        per_row = ((row_len + 255) // 256).to(tl.int32)
        first = tl.cast(start, tl.int32)
        lane = first + tl.arange(0, QB)  # the lanes' blocks in the first tile
        r = lane // per_row
        step_rows = QB // per_row  # a tile further on: so many rows and step_cols columns
        tail = (row_len - (per_row - 1) * 256).to(tl.int32)  # the length of a row's last block
        return (n - row_len, row_len, per_row, first, r, lane - r * per_row, step_rows,
                QB - step_rows * per_row, tail)
    else:
        return n, start


@triton.jit
def _tile(at, it, BLOCK: tl.constexpr, QB: tl.constexpr, FORM: tl.constexpr,
          ALIGNED: tl.constexpr):
    """Iteration ``it`` of a program's chunk (``at``: :func:`_blocks`): the elements' offsets
    and mask, and the int8 blocks' indices and mask. For int8 moments (FORM 2) a tile of QB
    blocks (its rows), each of 256 lanes, from block ``start + it * QB``: block b is in row
    b // per_row of the tensor, from column (b % per_row) * 256, and shorter where the row
    ends (each lane's row and column: those of the first tile, moved ``it`` tiles on, each
    move a few additions and one carry, which the iterations before share as compiled);
    where rows are whole blocks, elements 256 b to 256 b + 255. Otherwise BLOCK
    elements from element ``start + it * BLOCK`` (the blocks: the elements). The tensor holds
    whole rows (a local piece of its rows), so whole blocks."""
    if FORM == _FORM_INT8 and ALIGNED == _WHOLE_BLOCKS:  # block b: elements 256 b on
        blocks, first = at
        b = first + it * QB + tl.arange(0, QB)
        offs = (b.to(tl.int64) * 256)[:, None] + tl.arange(0, 256)[None, :]
        bmask = b < blocks
        mask = tl.broadcast_to(bmask[:, None], (QB, 256))
    elif FORM == _FORM_INT8:
        last_row, row_len, per_row, first, r, c, step_rows, step_cols, tail = at
        for _ in tl.static_range(it):  # (the iterations before compute the same: shared)
            c += step_cols
            carry = c >= per_row
            c = tl.where(carry, c - per_row, c)
            r += step_rows + carry.to(tl.int32)
        begins = r.to(tl.int64) * row_len  # the lanes' rows
        length = tl.where(c == per_row - 1, tail, 256)
        if ALIGNED:
            length = tl.multiple_of(length, _VECTOR)
        offs = (begins + c.to(tl.int64) * 256)[:, None] + tl.arange(0, 256)[None, :]
        b = first + it * QB + tl.arange(0, QB)
        bmask = begins <= last_row  # a whole row of the tensor
        mask = bmask[:, None] & (tl.arange(0, 256)[None, :] < length[:, None])
    else:
        n, start = at
        if ALIGNED:  # (the same numbers, in a form whose divisibility the compiler sees)
            n = n // _VECTOR * _VECTOR
            start = start // _VECTOR * _VECTOR
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        b = offs
        bmask = mask
    return offs, mask, b, bmask


@triton.jit
def _load_moments(row, mp, vp, offs, mask, b, bmask, FORM: tl.constexpr):
    """The stored moments as float32: as they are; bfloat16 widened; int8 codes decoded with
    their blocks' scales, (q |q|) (s / 127^2) and (F(q) - 2^-31) (s / 1.875), F(q) the float
    of bits (q + 768) << 20 (``_compact``)."""
    if FORM == _FORM_INT8:
        m_scales = tl.load(row + _M_SCALE).to(tl.pointer_type(tl.float32))
        v_scales = tl.load(row + _V_SCALE).to(tl.pointer_type(tl.float32))
        sm = tl.load(m_scales + b, mask=bmask, other=0.0)
        sv = tl.load(v_scales + b, mask=bmask, other=0.0)
        qm = tl.load(mp + offs, mask=mask, other=0).to(tl.int32)
        qv = tl.load(vp + offs, mask=mask, other=0).to(tl.uint32)
        fv = ((qv + _CODE_OFFSET) << _CODE_SHIFT).to(tl.float32, bitcast=True)
        m = (qm * tl.abs(qm)).to(tl.float32) * tl.math.div_rn(sm, _SIGNED_SCALE)[:, None]
        v = (fv - _CODE_LOW) * tl.math.div_rn(sv, _UNSIGNED_SCALE)[:, None]
    elif FORM == _FORM_BFLOAT16:
        m = (tl.load(mp + offs, mask=mask, other=0).to(tl.uint32) << 16).to(tl.float32,
                                                                             bitcast=True)
        v = (tl.load(vp + offs, mask=mask, other=0).to(tl.uint32) << 16).to(tl.float32,
                                                                             bitcast=True)
    else:
        m = tl.load(mp + offs, mask=mask, other=0.0)
        v = tl.load(vp + offs, mask=mask, other=0.0)
    return m, v


@triton.jit
def _hash32(h):
    """The 32-bit hash of h (uint32: an index plus the key), as ``_compact._hash32``."""
    h = ((h >> 16) ^ h) * _HASH_MUL
    h = ((h >> 16) ^ h) * _HASH_MUL
    return (h >> 16) ^ h


@triton.jit
def _random16(h):
    """16 random bits (uint32), the lower half of the hash of h (the element's global index
    plus the key), as ``_compact.random16``."""
    return _hash32(h) & 0xFFFF


@triton.jit
def _round_bf16(x, h):
    """x rounded to bfloat16 (its bits, uint16) up or down by the random bits of h, as
    ``_compact.round_bf16``."""
    return ((x.to(tl.uint32, bitcast=True) + _random16(h)) >> 16).to(tl.uint16)


@triton.jit
def _store_codes(cp, sp, offs, mask, b, bmask, x, h, SIGNED: tl.constexpr,
                 WHOLE: tl.constexpr):
    """x as int8 codes of its tile's blocks (rows), and their scales (each block's largest
    magnitude, NaNs passed over): the codes of ``_compact.quantize``. Signed: the square roots
    rounded halves up in exact arithmetic (an estimate of the root, then one exact
    comparison); unsigned: 8-bit floats rounded stochastically with the random bits of
    ``_compact.code_random16`` (h: the element's global index plus the key; the tile's columns
    are the positions in the blocks), each operation exact or rounded once: the product and
    the sum each rounded on its own (the kernels compile without contraction,
    ``_triton.COMPILE_OPTIONS``: no fused multiply-add rounds them once). WHOLE: the tile's
    blocks are whole (a block past the tensor's end is not stored), so no lane is masked
    inside a block."""
    live = (x == x) if WHOLE else mask & (x == x)
    a = tl.where(live, tl.abs(x), 0.0)  # a NaN: 0 (passed over; its code 0)
    s = tl.max(a, axis=1)
    tl.store(sp + b, s, mask=bmask)
    if SIGNED:
        c = tl.where(s > 0.0, tl.math.div_rn(tl.zeros_like(s) + _SIGNED_SCALE,
                                             tl.where(s > 0.0, s, 1.0)), 0.0)
        y = a * c[:, None]
        q = tl.where(y > 0.0, tl.floor(tl.sqrt(y) + _ROOT_OFFSET), 0.0)  # estimate: q or q - 1
        half = q + 0.5
        q = tl.where(half * half <= y, q + 1.0, q)
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000  # q with x's sign: -0 stores 0
        tl.store(cp + offs, (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
                 .to(tl.int8), mask=mask)
    else:
        c = tl.where(s > 0.0, tl.math.div_rn(tl.zeros_like(s) + _UNSIGNED_SCALE,
                                             tl.where(s > 0.0, s, 1.0)), 0.0)
        y = a * c[:, None]
        z = y + _CODE_LOW
        z = tl.where(z >= _CODE_LOW, z, _CODE_LOW)  # NaN: code 0
        p = tl.arange(0, 256)[None, :].to(tl.uint32)
        pair = _hash32(h - p + ((p >> 5) << 4) + (p & 15))
        r = (pair >> (p & 16)) & 0xFFFF  # the upper half at p + 16, the lower at p
        bits = z.to(tl.uint32, bitcast=True) + (r << 4)
        q = tl.minimum((bits >> _CODE_SHIFT) - _CODE_OFFSET, 255)
        tl.store(cp + offs, q.to(tl.uint8), mask=mask)


@triton.jit
def _store_moments(row, mp, vp, offs, mask, b, bmask, m, v, step, FORM: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """The new moments stored in their form: as they are; bfloat16 rounded stochastically with
    the bits of the element's global index (the local piece's offset plus its own) and the
    step's keys (salts 1 and 2); int8 codes and scales (the second moment's rounded with the
    bits of salt 2; ALIGNED: the tile's variant, :func:`_tile`)."""
    index = (tl.load(row + _OFFSET) + offs).to(tl.uint32)
    key = step.to(tl.int64).to(tl.uint32) * _STEP_MUL
    if FORM == _FORM_INT8:
        _store_codes(mp, tl.load(row + _M_SCALE).to(tl.pointer_type(tl.float32)), offs, mask, b,
                     bmask, m, index, True, ALIGNED == _WHOLE_BLOCKS)
        _store_codes(vp, tl.load(row + _V_SCALE).to(tl.pointer_type(tl.float32)), offs, mask, b,
                     bmask, v, index + (key + _V_SALT), False, ALIGNED == _WHOLE_BLOCKS)
    elif FORM == _FORM_BFLOAT16:
        tl.store(mp + offs, _round_bf16(m, index + (key + _M_SALT)), mask=mask)
        tl.store(vp + offs, _round_bf16(v, index + (key + _V_SALT)), mask=mask)
    else:
        tl.store(mp + offs, m, mask=mask)
        tl.store(vp + offs, v, mask=mask)


@triton.jit
def _load_w(wp, w16p, offs, mask, W_SPLIT: tl.constexpr):
    """The float32 weights: a split master joined (``_masters.split_join``), or as stored."""
    if W_SPLIT:
        hi = tl.load(wp + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = tl.load(w16p + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        top = (hi - (lo >> 15)) & 0xFFFF
        return ((top << 16) | lo).to(tl.float32, bitcast=True)
    else:
        return tl.load(wp + offs, mask=mask, other=0.0)


@triton.jit
def _store_w(wp, w16p, offs, mask, w, W_SPLIT: tl.constexpr, W16_KIND: tl.constexpr):
    """The new float32 weights: split again (``_masters.split_``), or stored with their rounded
    copy where w16 asks for one."""
    if W_SPLIT:
        bits = w.to(tl.uint32, bitcast=True)
        top = ((bits + 0x8000) >> 16) & 0xFFFF
        tl.store(wp + offs, top.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        tl.store(w16p + offs, (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(wp + offs, w, mask=mask)
        if W16_KIND == _W16_BFLOAT16:
            tl.store(w16p + offs, _bf16_nearest(w).to(tl.bfloat16, bitcast=True), mask=mask)
        elif W16_KIND == _W16_FLOAT16:
            tl.store(w16p + offs, w.to(tl.float16), mask=mask)


@triton.jit
def _bf16_nearest(x):
    """x rounded to the nearest bfloat16, ties to even, a NaN kept a quiet NaN: its bits
    (uint16), as the C kernels' ``f32_to_bf16`` (by integer operations: Triton's interpreter
    converts by truncation, the compiled code to nearest)."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, rounded).to(tl.uint16)


@triton.jit
def _load_g(gp, offs, mask, mult, clip_lo, clip_hi, CLIP: tl.constexpr):
    g = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32) * mult
    if CLIP:
        g = tl.minimum(tl.maximum(g, clip_lo), clip_hi)
    return g


@triton.jit
def _moments(m, v, g, beta2, one_m_b1, one_m_b2):
    """Adam's moments updated with ``g``. 1 - beta1 and 1 - beta2 come from the host (in
    float64 there, then rounded once to float32 as the reference rounds them): computed here
    they would be rounded twice when compiled (beta1 a float32 argument) and once under the
    interpreter (a Python float), two different numbers."""
    return m + one_m_b1 * (g - m), v * beta2 + one_m_b2 * g * g


@triton.jit
def _trust_ratio(w2, u2, lower, upper, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr):
    """phi(||w||) / ||u|| from squared norms; 1 where either is 0 or the ratio not finite."""
    w = tl.sqrt_rn(w2)
    u = tl.sqrt_rn(u2)
    if HAS_LOWER:
        w = tl.maximum(w, lower)
    if HAS_UPPER:
        w = tl.minimum(w, upper)
    ok = (w > 0.0) & (u > 0.0)
    ratio = tl.div_rn(w, tl.where(ok, u, 1.0))
    return tl.where(ok & (ratio <= _BIG), ratio, 1.0)


@triton.jit
def _program(ptrs, sizes, chunks, scal, skip):
    """This program's chunk: the tensor's row of ``ptrs``, its size (0 when ``skip[0]`` is set:
    a GradScaler found an inf, and nothing is read or written), where the chunk starts (an
    element, or an int8 block), its slot for partial sums, the tensor's place in the group,
    and its step's numbers."""
    row, n, start, slot = _chunk(ptrs, sizes, chunks)
    i = tl.load(row + _INDEX)
    s = scal + _SCAL * i
    n = tl.where(tl.load(skip) == 0.0, n, 0)
    return (row, n, start, slot, i, tl.load(s + _LR), tl.load(s + _WD), tl.load(s + _ADAPT),
            tl.load(s + _GRAD_MULT), tl.load(s + _BC1), tl.load(s + _BC2), tl.load(s + _T))


@triton.jit
def _chunk(ptrs, sizes, chunks):
    """Row ``program_id`` of the chunk table (tensor k, where the chunk starts, its slot): the
    tensor's row of ``ptrs``, its size, the start and the slot."""
    c = chunks + _CHUNK * tl.program_id(0)
    k = tl.load(c + _TENSOR)
    return ptrs + _ROW * k, tl.load(sizes + k), tl.load(c + _START), tl.load(c + _SLOT)


@triton.jit
def _decay_factor(lr, wd, MODE: tl.constexpr):
    """The decoupled mode's (1) weight decay before the step, w * (1 - lr * wd); else 1."""
    if MODE == _MODE_DECOUPLED:
        return 1.0 - lr * wd
    else:
        return lr * 0.0 + 1.0


@triton.jit
def sum_squares(ptrs, grads, sizes, chunks, parts, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr,
                W16_KIND: tl.constexpr, FORM: tl.constexpr, ALIGNED: tl.constexpr,
                BLOCK: tl.constexpr, QB: tl.constexpr, ITERS: tl.constexpr):
    """parts[slot] = the chunk's sum of g^2 (LANS's gradient norms; ``totals`` adds them up)."""
    row, n, start, slot = _chunk(ptrs, sizes, chunks)
    _, gp, _, _, _ = _pointers(row, grads, W_SPLIT, G_KIND, W16_KIND, FORM, ALIGNED)
    acc = 0.0
    at = _blocks(row, n, start, QB, FORM, ALIGNED)
    for it in tl.static_range(ITERS):
        offs, mask, _, _ = _tile(at, it, BLOCK, QB, FORM, ALIGNED)
        g = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(g * g)
    tl.store(parts + slot, acc)


@triton.jit
def _part(x, FORM: tl.constexpr, ALIGNED: tl.constexpr):
    """A tile's part of a chunk's sum: for int8 tiles of 16-byte vectors the sums of its
    blocks (its rows, each summed inside one warp), added up by :func:`_whole` after the last
    tile; else the tile's sum (the cheaper in instructions for each, compiled)."""
    if FORM == _FORM_INT8 and ALIGNED:
        return tl.sum(x, axis=1)
    else:
        return tl.sum(x)


@triton.jit
def _whole(acc, FORM: tl.constexpr, ALIGNED: tl.constexpr):
    """The chunk's sum from its tiles' parts (:func:`_part`)."""
    if FORM == _FORM_INT8 and ALIGNED:
        return tl.sum(acc)
    else:
        return acc


@triton.jit
def _lamb_moments(w, g, m, v, lr, wd, beta2, one_m_b1, one_m_b2, MODE: tl.constexpr):
    """w decayed first in the decoupled mode (1), and LAMB's new moments from the old ones and
    the gradient (with w's L2 term in mode 2)."""
    w = w * _decay_factor(lr, wd, MODE)
    if MODE == _MODE_L2:
        g = g + wd * w
    m, v = _moments(m, v, g, beta2, one_m_b1, one_m_b2)
    return w, m, v


@triton.jit
def _unbiased_by_reciprocals(m, v, inv_bc1, inv_bc2):
    """m and sqrt(v) multiplied by the bias corrections' reciprocals (:func:`_reciprocals`),
    as the C kernels do: two divisions fewer per element than the reference loop's."""
    return m * inv_bc1, tl.sqrt_rn(v) * inv_bc2


@triton.jit
def _reciprocals(bc1, bc2):
    """1 / (1 - beta1^t) and 1 / sqrt(1 - beta2^t), correctly rounded, once per program:
    divided in float64 and rounded to float32, the bits of a float32 division (float64 has
    more than twice float32's precision, so rounding twice rounds as once); a float32
    division's out-of-line slow path here made ptxas spill registers on sm_80."""
    return ((1.0 / bc1.to(tl.float64)).to(tl.float32),
            (1.0 / bc2.to(tl.float64)).to(tl.float32))


@triton.jit
def _lamb_u(w, m_hat, d, wd, eps, MODE: tl.constexpr):
    """LAMB's update u = m^ / (d + eps) (d: sqrt(v^)), decay included (mode 0)."""
    u = tl.div_rn(m_hat, d + eps)
    if MODE == _MODE_UPDATE:
        u = u + wd * w
    return u


@triton.jit
def lamb_sums(ptrs, grads, sizes, chunks, scal, skip, parts, beta2, one_m_b1, one_m_b2, eps,
              clip_lo, clip_hi, lower, upper, MODE: tl.constexpr, CLIP: tl.constexpr,
              HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, W_SPLIT: tl.constexpr,
              G_KIND: tl.constexpr, W16_KIND: tl.constexpr, FORM: tl.constexpr,
              ALIGNED: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr, ITERS: tl.constexpr):
    """LAMB's first phase: the chunk's sum w^2 and sum u^2 into its slot of ``parts`` (u the
    full update, decay included; w decayed first in the decoupled mode, 1). float32 moments are
    stored updated; stored ones (FORM 1, 2) are left for the second phase to update and
    store."""
    row, n, start, slot, _, lr, wd, _, mult, bc1, bc2, _ = _program(ptrs, sizes, chunks, scal,
                                                                    skip)
    wp, gp, mp, vp, w16p = _pointers(row, grads, W_SPLIT, G_KIND, W16_KIND, FORM, ALIGNED)
    inv_bc1, inv_bc2 = _reciprocals(bc1, bc2)
    acc_w = 0.0
    acc_u = 0.0
    at = _blocks(row, n, start, QB, FORM, ALIGNED)
    for it in tl.static_range(ITERS):
        offs, mask, b, bmask = _tile(at, it, BLOCK, QB, FORM, ALIGNED)
        m, v = _load_moments(row, mp, vp, offs, mask, b, bmask, FORM)
        w, m, v = _lamb_moments(_load_w(wp, w16p, offs, mask, W_SPLIT),
                                _load_g(gp, offs, mask, mult, clip_lo, clip_hi, CLIP), m, v,
                                lr, wd, beta2, one_m_b1, one_m_b2, MODE)
        if FORM == _FORM_FLOAT32:
            tl.store(mp + offs, m, mask=mask)
            tl.store(vp + offs, v, mask=mask)
        m_hat, d = _unbiased_by_reciprocals(m, v, inv_bc1, inv_bc2)
        u = _lamb_u(w, m_hat, d, wd, eps, MODE)
        acc_w += _part(w * w, FORM, ALIGNED)
        acc_u += _part(u * u, FORM, ALIGNED)
    tl.store(parts + 2 * slot, _whole(acc_w, FORM, ALIGNED))
    tl.store(parts + 2 * slot + 1, _whole(acc_u, FORM, ALIGNED))


@triton.jit
def lamb_apply(ptrs, grads, sizes, chunks, scal, skip, sums, beta2, one_m_b1, one_m_b2, eps,
               clip_lo, clip_hi, lower, upper, MODE: tl.constexpr, CLIP: tl.constexpr,
               HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, W_SPLIT: tl.constexpr,
               G_KIND: tl.constexpr, W16_KIND: tl.constexpr, FORM: tl.constexpr,
               ALIGNED: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr, ITERS: tl.constexpr):
    """LAMB's second phase: w - lr * ratio * u, the ratio from the (totalled) sums. Stored
    moments are updated again from the gradient, as the first phase did, and stored."""
    row, n, start, _, i, lr, wd, adapt, mult, bc1, bc2, step = _program(ptrs, sizes, chunks,
                                                                        scal, skip)
    wp, gp, mp, vp, w16p = _pointers(row, grads, W_SPLIT, G_KIND, W16_KIND, FORM, ALIGNED)
    ratio = _trust_ratio(tl.load(sums + 2 * i), tl.load(sums + 2 * i + 1), lower, upper,
                         HAS_LOWER, HAS_UPPER)
    ratio = tl.where(adapt > 0.0, ratio, 1.0)
    inv_bc1, inv_bc2 = _reciprocals(bc1, bc2)
    at = _blocks(row, n, start, QB, FORM, ALIGNED)
    for it in tl.static_range(ITERS):
        offs, mask, b, bmask = _tile(at, it, BLOCK, QB, FORM, ALIGNED)
        m, v = _load_moments(row, mp, vp, offs, mask, b, bmask, FORM)
        w = _load_w(wp, w16p, offs, mask, W_SPLIT)
        if FORM == _FORM_FLOAT32:  # the moments the first phase stored
            w = w * _decay_factor(lr, wd, MODE)
        else:
            w, m, v = _lamb_moments(w, _load_g(gp, offs, mask, mult, clip_lo, clip_hi, CLIP),
                                    m, v, lr, wd, beta2, one_m_b1, one_m_b2, MODE)
            _store_moments(row, mp, vp, offs, mask, b, bmask, m, v, step, FORM, ALIGNED)
        m_hat, d = _unbiased_by_reciprocals(m, v, inv_bc1, inv_bc2)
        u = _lamb_u(w, m_hat, d, wd, eps, MODE)
        _store_w(wp, w16p, offs, mask, w - lr * (ratio * u), W_SPLIT, W16_KIND)


@triton.jit
def _normalising_factor(gsq, i, mult):
    """The normalised gradient of g * mult is sign(mult) * g / ||g||: its factor (0 for a zero
    gradient, NaN for a non-finite one)."""
    gnorm = tl.abs(mult) * tl.sqrt_rn(tl.load(gsq + i))
    return tl.where(gnorm == 0.0, 0.0, tl.div_rn(mult, tl.where(gnorm == 0.0, 1.0, gnorm)))


@triton.jit
def _lans_r(w, m_hat, d, wd, eps):
    """LANS's 1/(d + eps) and update r = m^ / (d + eps) (d: sqrt(v^))."""
    dinv = tl.div_rn(1.0, d + eps)
    return dinv, m_hat * dinv + wd * w


@triton.jit
def lans_sums(ptrs, grads, sizes, chunks, scal, skip, parts, gsq, beta2, one_m_b1, one_m_b2, eps,
              clip_lo, clip_hi, lower, upper, CLIP: tl.constexpr, HAS_LOWER: tl.constexpr,
              HAS_UPPER: tl.constexpr, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr,
              W16_KIND: tl.constexpr, FORM: tl.constexpr, ALIGNED: tl.constexpr,
              BLOCK: tl.constexpr, QB: tl.constexpr, ITERS: tl.constexpr):
    """LANS's first phase: m, v updated from the normalised gradient (stored where float32);
    the chunk's sums of w^2, r^2, c^2 and r*c into its slot of ``parts``."""
    row, n, start, slot, i, lr, wd, _, mult, bc1, bc2, _ = _program(ptrs, sizes, chunks, scal,
                                                                    skip)
    wp, gp, mp, vp, w16p = _pointers(row, grads, W_SPLIT, G_KIND, W16_KIND, FORM, ALIGNED)
    ginv = _normalising_factor(gsq, i, mult)
    inv_bc1, inv_bc2 = _reciprocals(bc1, bc2)
    acc_w = 0.0
    acc_r = 0.0
    acc_c = 0.0
    acc_rc = 0.0
    at = _blocks(row, n, start, QB, FORM, ALIGNED)
    for it in tl.static_range(ITERS):
        offs, mask, b, bmask = _tile(at, it, BLOCK, QB, FORM, ALIGNED)
        m, v = _load_moments(row, mp, vp, offs, mask, b, bmask, FORM)
        w = _load_w(wp, w16p, offs, mask, W_SPLIT)
        g = _load_g(gp, offs, mask, ginv, clip_lo, clip_hi, CLIP)
        m, v = _moments(m, v, g, beta2, one_m_b1, one_m_b2)
        if FORM == _FORM_FLOAT32:
            tl.store(mp + offs, m, mask=mask)
            tl.store(vp + offs, v, mask=mask)
        m_hat, d = _unbiased_by_reciprocals(m, v, inv_bc1, inv_bc2)
        dinv, r = _lans_r(w, m_hat, d, wd, eps)
        c = g * dinv + wd * w
        acc_w += _part(w * w, FORM, ALIGNED)
        acc_r += _part(r * r, FORM, ALIGNED)
        acc_c += _part(c * c, FORM, ALIGNED)
        acc_rc += _part(r * c, FORM, ALIGNED)
    tl.store(parts + 4 * slot, _whole(acc_w, FORM, ALIGNED))
    tl.store(parts + 4 * slot + 1, _whole(acc_r, FORM, ALIGNED))
    tl.store(parts + 4 * slot + 2, _whole(acc_c, FORM, ALIGNED))
    tl.store(parts + 4 * slot + 3, _whole(acc_rc, FORM, ALIGNED))


@triton.jit
def lans_apply(ptrs, grads, sizes, chunks, scal, skip, sums, gsq, beta1, beta2, one_m_b1, one_m_b2,
               eps, clip_lo, clip_hi, lower, upper, MOVED: tl.constexpr, CLIP: tl.constexpr,
               HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr, W_SPLIT: tl.constexpr,
               G_KIND: tl.constexpr, W16_KIND: tl.constexpr, FORM: tl.constexpr,
               ALIGNED: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr, ITERS: tl.constexpr):
    """LANS's second phase: w1 = w - lr_r * ratio_r * r, then w1 - lr_c * ratio_c * c, where c
    decays w1 when MOVED and w otherwise (the rates of r and c: lr_r = lr * beta1, lr_c = lr *
    (1 - beta1)). Stored moments are updated again, as the first phase did, and stored."""
    row, n, start, _, i, lr, wd, adapt, mult, bc1, bc2, step = _program(ptrs, sizes, chunks,
                                                                        scal, skip)
    wp, gp, mp, vp, w16p = _pointers(row, grads, W_SPLIT, G_KIND, W16_KIND, FORM, ALIGNED)
    ginv = _normalising_factor(gsq, i, mult)
    inv_bc1, inv_bc2 = _reciprocals(bc1, bc2)
    lr_r = lr * beta1
    lr_c = lr * one_m_b1
    w2 = tl.load(sums + 4 * i)
    r2 = tl.load(sums + 4 * i + 1)
    c2 = tl.load(sums + 4 * i + 2)
    ratio_r = tl.where(adapt > 0.0, _trust_ratio(w2, r2, lower, upper, HAS_LOWER, HAS_UPPER), 1.0)
    if MOVED:  # c' = c - wd*lr_r*ratio_r*r: ||c'||^2 from the first phase's sums
        k = wd * lr_r * ratio_r
        c2 = tl.maximum(c2 - 2.0 * k * tl.load(sums + 4 * i + 3) + k * k * r2, 0.0)
    ratio_c = tl.where(adapt > 0.0, _trust_ratio(w2, c2, lower, upper, HAS_LOWER, HAS_UPPER), 1.0)
    at = _blocks(row, n, start, QB, FORM, ALIGNED)
    for it in tl.static_range(ITERS):
        offs, mask, b, bmask = _tile(at, it, BLOCK, QB, FORM, ALIGNED)
        m, v = _load_moments(row, mp, vp, offs, mask, b, bmask, FORM)
        w = _load_w(wp, w16p, offs, mask, W_SPLIT)
        g = _load_g(gp, offs, mask, ginv, clip_lo, clip_hi, CLIP)
        if FORM != _FORM_FLOAT32:  # else the moments the first phase stored
            m, v = _moments(m, v, g, beta2, one_m_b1, one_m_b2)
            _store_moments(row, mp, vp, offs, mask, b, bmask, m, v, step, FORM, ALIGNED)
        m_hat, d = _unbiased_by_reciprocals(m, v, inv_bc1, inv_bc2)
        dinv, r = _lans_r(w, m_hat, d, wd, eps)
        w1 = w - lr_r * (ratio_r * r)
        if MOVED:
            c = g * dinv + wd * w1
        else:
            c = g * dinv + wd * w
        _store_w(wp, w16p, offs, mask, w1 - lr_c * (ratio_c * c), W_SPLIT, W16_KIND)


@triton.jit
def adam_apply(ptrs, grads, sizes, chunks, adam, skip, beta1, one_m_b1, beta2, one_m_b2, eps,
               NESTEROV: tl.constexpr, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr,
               W16_KIND: tl.constexpr, FORM: tl.constexpr, ALIGNED: tl.constexpr,
               BLOCK: tl.constexpr, QB: tl.constexpr, ITERS: tl.constexpr):
    """Adam and AdamW in one pass, the C kernel's operations in its order (``csrc/adam.h``):
    g' = g * mult + wd_l2 * w; m = m + (1 - beta1)(g' - m); v = v beta2 + (1 - beta2) g' g';
    w = w * decay - step_size * (n / (sqrt(v) / bc2_sqrt + eps)), n = m or, with NESTEROV,
    beta1 m + (1 - beta1) g'; for a split master sqrt(v) * (1 / bc2_sqrt) + eps. The
    tensor's scalars are its row of ``adam`` (``ADAM``); moments stored as their form."""
    row, n, start, _ = _chunk(ptrs, sizes, chunks)
    a = adam + _ADAM * tl.load(row + _INDEX)
    step_size = tl.load(a + _A_STEP_SIZE)
    bc2 = tl.load(a + _A_BC2)
    inv_bc2 = tl.load(a + _A_INV_BC2)
    wd_l2 = tl.load(a + _A_WD_L2)
    decay = tl.load(a + _A_DECAY)
    mult = tl.load(a + _A_GRAD_MULT)
    step = tl.load(a + _A_T)
    n = tl.where(tl.load(skip) == 0.0, n, 0)
    wp, gp, mp, vp, w16p = _pointers(row, grads, W_SPLIT, G_KIND, W16_KIND, FORM, ALIGNED)
    at = _blocks(row, n, start, QB, FORM, ALIGNED)
    for it in tl.static_range(ITERS):
        offs, mask, b, bmask = _tile(at, it, BLOCK, QB, FORM, ALIGNED)
        m, v = _load_moments(row, mp, vp, offs, mask, b, bmask, FORM)
        w = _load_w(wp, w16p, offs, mask, W_SPLIT)
        g = _load_g(gp, offs, mask, mult, 0.0, 0.0, False) + wd_l2 * w
        m, v = _moments(m, v, g, beta2, one_m_b1, one_m_b2)
        if FORM == _FORM_FLOAT32:
            tl.store(mp + offs, m, mask=mask)
            tl.store(vp + offs, v, mask=mask)
        else:
            _store_moments(row, mp, vp, offs, mask, b, bmask, m, v, step, FORM, ALIGNED)
        if NESTEROV:
            m = beta1 * m + one_m_b1 * g
        if W_SPLIT:
            den = tl.sqrt_rn(v) * inv_bc2 + eps
        else:
            den = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
        _store_w(wp, w16p, offs, mask, w * decay - step_size * tl.div_rn(m, den), W_SPLIT,
                 W16_KIND)


@triton.jit
def totals(parts, spans, sums, S: tl.constexpr, R: tl.constexpr):
    """One program per tensor i of the group: sums[S i + j] = the total of the partial sums j
    of its chunks (``parts``, S per slot; the tensor's slots are ``spans[2i]`` and the
    ``spans[2i + 1]`` after it). Always in the same order, whatever order the chunks' programs
    ran in: lane r of R adds slots r, r + R, r + 2R ... in turn, then the lanes are added as
    ``tl.sum`` adds them. So two runs give the same bits, as no float atomic would."""
    i = tl.program_id(0)
    first = tl.load(spans + 2 * i)
    count = tl.load(spans + 2 * i + 1)
    cols = tl.arange(0, S)
    acc = tl.zeros([R, S], dtype=tl.float32)
    j = 0
    while j < count:
        r = j + tl.arange(0, R)
        acc += tl.load(parts + (first + r)[:, None] * S + cols[None, :],
                       mask=(r < count)[:, None], other=0.0)
        j += R
    tl.store(sums + S * i + cols, tl.sum(acc, axis=0))
