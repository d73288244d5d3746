"""The Triton kernels of ``scaleopt._triton`` (imported at their first launch).

Every kernel runs one program per (tensor, chunk) pair: ``chunks[pid]`` is (k, first element),
row k of ``ptrs`` holds the tensor's addresses (w, g, m, v, low) and its place i in the group,
``sizes[k]`` its size. Row i of ``scal``: lr, weight decay, adapt, gradient multiplier, and the
bias corrections 1 - beta1^t and sqrt(1 - beta2^t) of its step. The arithmetic is the C
kernels' (``_kernels.c``), step for step. Kinds (compile-time): ``W_SPLIT`` a split master (the
weight's bfloat16 upper halves at w, the int16 lower halves at low) or a float32 weight;
``G_KIND`` the gradient's dtype (0 float32, 1 bfloat16, 2 float16); ``LOW_KIND`` what low holds
(0 nothing, 1 / 2 the rounded bfloat16 / float16 weights to write, 3 a split master's lower
halves).
"""

import triton
import triton.language as tl

_ROW = 6  # int64 entries per row of ``ptrs``
_SCAL = 6  # float32 entries per row of ``scal``
_BIG = 3.4028234663852886e38  # the largest float32: a ratio above it is not finite


@triton.jit
def _pointers(row, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr, LOW_KIND: tl.constexpr):
    if W_SPLIT:
        wp = tl.load(row).to(tl.pointer_type(tl.int16))
    else:
        wp = tl.load(row).to(tl.pointer_type(tl.float32))
    if G_KIND == 1:
        gp = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
    elif G_KIND == 2:
        gp = tl.load(row + 1).to(tl.pointer_type(tl.float16))
    else:
        gp = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    mp = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    vp = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if LOW_KIND == 1:
        lp = tl.load(row + 4).to(tl.pointer_type(tl.bfloat16))
    elif LOW_KIND == 2:
        lp = tl.load(row + 4).to(tl.pointer_type(tl.float16))
    else:
        lp = tl.load(row + 4).to(tl.pointer_type(tl.int16))
    return wp, gp, mp, vp, lp


@triton.jit
def _load_w(wp, lp, offs, mask, W_SPLIT: tl.constexpr):
    """The float32 weights: a split master joined (``_masters.split_join``), or as stored."""
    if W_SPLIT:
        hi = tl.load(wp + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = tl.load(lp + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        top = (hi - (lo >> 15)) & 0xFFFF
        return ((top << 16) | lo).to(tl.float32, bitcast=True)
    else:
        return tl.load(wp + offs, mask=mask, other=0.0)


@triton.jit
def _store_w(wp, lp, offs, mask, w, W_SPLIT: tl.constexpr, LOW_KIND: tl.constexpr):
    """The new float32 weights: split again (``_masters.split_``), or stored with their rounded
    copy where low asks for one."""
    if W_SPLIT:
        bits = w.to(tl.uint32, bitcast=True)
        top = ((bits + 0x8000) >> 16) & 0xFFFF
        tl.store(wp + offs, top.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        tl.store(lp + offs, (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(wp + offs, w, mask=mask)
        if LOW_KIND == 1:
            tl.store(lp + offs, w.to(tl.bfloat16), mask=mask)
        elif LOW_KIND == 2:
            tl.store(lp + offs, w.to(tl.float16), mask=mask)


@triton.jit
def _load_g(gp, offs, mask, mult, clip_lo, clip_hi, CLIP: tl.constexpr):
    g = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32) * mult
    if CLIP:
        g = tl.minimum(tl.maximum(g, clip_lo), clip_hi)
    return g


@triton.jit
def _load_wgmv(wp, gp, mp, vp, lp, offs, mask, mult, clip_lo, clip_hi, W_SPLIT: tl.constexpr,
               CLIP: tl.constexpr):
    """A block's float32 weights, gradients (times ``mult``, clamped with CLIP) and moments."""
    w = _load_w(wp, lp, offs, mask, W_SPLIT)
    g = _load_g(gp, offs, mask, mult, clip_lo, clip_hi, CLIP)
    m = tl.load(mp + offs, mask=mask, other=0.0)
    v = tl.load(vp + offs, mask=mask, other=0.0)
    return w, g, m, v


@triton.jit
def _moments_(mp, vp, offs, mask, m, v, g, beta1, beta2):
    """Adam's moments updated with ``g``, stored, and returned."""
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    tl.store(mp + offs, m, mask=mask)
    tl.store(vp + offs, v, mask=mask)
    return m, v


@triton.jit
def _trust_ratio(w2, u2, lower, upper, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr):
    """phi(||w||) / ||u|| from squared norms; 1 where either is 0 or the ratio not finite."""
    w = tl.sqrt(w2)
    u = tl.sqrt(u2)
    if HAS_LOWER:
        w = tl.maximum(w, lower)
    if HAS_UPPER:
        w = tl.minimum(w, upper)
    ok = (w > 0.0) & (u > 0.0)
    ratio = w / tl.where(ok, u, 1.0)
    return tl.where(ok & (ratio <= _BIG), ratio, 1.0)


@triton.jit
def _program(ptrs, sizes, chunks, scal, skip):
    """This program's chunk: the tensor's row of ``ptrs``, its size (0 when ``skip[0]`` is set:
    a GradScaler found an inf, and nothing is read or written), its first element, its place
    in the group, and its step's numbers."""
    pid = tl.program_id(0)
    k = tl.load(chunks + 2 * pid)
    start = tl.load(chunks + 2 * pid + 1)
    row = ptrs + _ROW * k
    i = tl.load(row + 5)
    s = scal + _SCAL * i
    n = tl.where(tl.load(skip) == 0.0, tl.load(sizes + k), 0)
    return (row, n, start, i, tl.load(s), tl.load(s + 1), tl.load(s + 2),
            tl.load(s + 3), tl.load(s + 4), tl.load(s + 5))


@triton.jit
def _decay_factor(lr, wd, MODE: tl.constexpr):
    """The decoupled mode's (1) weight decay before the step, w * (1 - lr * wd); else 1."""
    if MODE == 1:
        return 1.0 - lr * wd
    else:
        return lr * 0.0 + 1.0


@triton.jit
def sum_squares(ptrs, sizes, chunks, sums, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr,
                LOW_KIND: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """sums[i] += the chunk's sum of g^2 (LANS's gradient norms)."""
    pid = tl.program_id(0)
    k = tl.load(chunks + 2 * pid)
    start = tl.load(chunks + 2 * pid + 1)
    n = tl.load(sizes + k)
    row = ptrs + _ROW * k
    _, gp, _, _, _ = _pointers(row, W_SPLIT, G_KIND, LOW_KIND)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for it in tl.static_range(ITERS):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        g = tl.load(gp + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += g * g
    tl.atomic_add(sums + tl.load(row + 5), tl.sum(acc, 0))


@triton.jit
def lamb_sums(ptrs, sizes, chunks, scal, skip, sums, beta1, beta2, eps, clip_lo, clip_hi, lower,
              upper,
              MODE: tl.constexpr, CLIP: tl.constexpr, HAS_LOWER: tl.constexpr,
              HAS_UPPER: tl.constexpr, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr,
              LOW_KIND: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """LAMB's first phase: m, v updated; sums[2i] += sum w^2, sums[2i+1] += sum u^2 (u the full
    update, decay included; w decayed first in the decoupled mode, 1)."""
    row, n, start, i, lr, wd, _, mult, bc1, bc2 = _program(ptrs, sizes, chunks, scal, skip)
    wp, gp, mp, vp, lp = _pointers(row, W_SPLIT, G_KIND, LOW_KIND)
    f = _decay_factor(lr, wd, MODE)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    for it in tl.static_range(ITERS):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w, g, m, v = _load_wgmv(wp, gp, mp, vp, lp, offs, mask, mult, clip_lo, clip_hi,
                                W_SPLIT, CLIP)
        w = w * f
        if MODE == 2:
            g = g + wd * w
        m, v = _moments_(mp, vp, offs, mask, m, v, g, beta1, beta2)
        u = (m / bc1) / (tl.sqrt(v) / bc2 + eps)
        if MODE == 0:
            u = u + wd * w
        acc_w += w * w
        acc_u += u * u
    tl.atomic_add(sums + 2 * i, tl.sum(acc_w, 0))
    tl.atomic_add(sums + 2 * i + 1, tl.sum(acc_u, 0))


@triton.jit
def lamb_apply(ptrs, sizes, chunks, scal, skip, sums, beta1, beta2, eps, clip_lo, clip_hi, lower,
               upper, MODE: tl.constexpr, CLIP: tl.constexpr, HAS_LOWER: tl.constexpr,
               HAS_UPPER: tl.constexpr, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr,
               LOW_KIND: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """LAMB's second phase: w - lr * ratio * u, the ratio from the (totalled) sums."""
    row, n, start, i, lr, wd, adapt, _, bc1, bc2 = _program(ptrs, sizes, chunks, scal, skip)
    wp, gp, mp, vp, lp = _pointers(row, W_SPLIT, G_KIND, LOW_KIND)
    ratio = _trust_ratio(tl.load(sums + 2 * i), tl.load(sums + 2 * i + 1), lower, upper,
                         HAS_LOWER, HAS_UPPER)
    ratio = tl.where(adapt > 0.0, ratio, 1.0)
    f = _decay_factor(lr, wd, MODE)
    for it in tl.static_range(ITERS):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = _load_w(wp, lp, offs, mask, W_SPLIT) * f
        m = tl.load(mp + offs, mask=mask, other=0.0)
        v = tl.load(vp + offs, mask=mask, other=0.0)
        u = (m / bc1) / (tl.sqrt(v) / bc2 + eps)
        if MODE == 0:
            u = u + wd * w
        _store_w(wp, lp, offs, mask, w - lr * (ratio * u), W_SPLIT, LOW_KIND)


@triton.jit
def _normalising_factor(gsq, i, mult):
    """The normalised gradient of g * mult is sign(mult) * g / ||g||: its factor (0 for a zero
    gradient, NaN for a non-finite one)."""
    gnorm = tl.abs(mult) * tl.sqrt(tl.load(gsq + i))
    return tl.where(gnorm == 0.0, 0.0, mult / tl.where(gnorm == 0.0, 1.0, gnorm))


@triton.jit
def lans_sums(ptrs, sizes, chunks, scal, skip, sums, gsq, beta1, beta2, eps, clip_lo, clip_hi,
              lower,
              upper, CLIP: tl.constexpr, HAS_LOWER: tl.constexpr, HAS_UPPER: tl.constexpr,
              W_SPLIT: tl.constexpr, G_KIND: tl.constexpr, LOW_KIND: tl.constexpr,
              BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """LANS's first phase: m, v updated from the normalised gradient; sums[4i..4i+3] +=
    sum w^2, r^2, c^2, r*c."""
    row, n, start, i, lr, wd, _, mult, bc1, bc2 = _program(ptrs, sizes, chunks, scal, skip)
    wp, gp, mp, vp, lp = _pointers(row, W_SPLIT, G_KIND, LOW_KIND)
    ginv = _normalising_factor(gsq, i, mult)
    acc_w = tl.zeros([BLOCK], dtype=tl.float32)
    acc_r = tl.zeros([BLOCK], dtype=tl.float32)
    acc_c = tl.zeros([BLOCK], dtype=tl.float32)
    acc_rc = tl.zeros([BLOCK], dtype=tl.float32)
    for it in tl.static_range(ITERS):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w, g, m, v = _load_wgmv(wp, gp, mp, vp, lp, offs, mask, ginv, clip_lo, clip_hi,
                                W_SPLIT, CLIP)
        m, v = _moments_(mp, vp, offs, mask, m, v, g, beta1, beta2)
        dinv = 1.0 / (tl.sqrt(v) / bc2 + eps)
        r = (m / bc1) * dinv + wd * w
        c = g * dinv + wd * w
        acc_w += w * w
        acc_r += r * r
        acc_c += c * c
        acc_rc += r * c
    tl.atomic_add(sums + 4 * i, tl.sum(acc_w, 0))
    tl.atomic_add(sums + 4 * i + 1, tl.sum(acc_r, 0))
    tl.atomic_add(sums + 4 * i + 2, tl.sum(acc_c, 0))
    tl.atomic_add(sums + 4 * i + 3, tl.sum(acc_rc, 0))


@triton.jit
def lans_apply(ptrs, sizes, chunks, scal, skip, sums, gsq, beta1, beta2, eps, clip_lo, clip_hi,
               lower,
               upper, MOVED: tl.constexpr, CLIP: tl.constexpr, HAS_LOWER: tl.constexpr,
               HAS_UPPER: tl.constexpr, W_SPLIT: tl.constexpr, G_KIND: tl.constexpr,
               LOW_KIND: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """LANS's second phase: w1 = w - a * ratio_r * r, then w1 - b * ratio_c * c, where c
    decays w1 when MOVED and w otherwise (a = lr * beta1, b = lr * (1 - beta1))."""
    row, n, start, i, lr, wd, adapt, mult, bc1, bc2 = _program(ptrs, sizes, chunks, scal, skip)
    wp, gp, mp, vp, lp = _pointers(row, W_SPLIT, G_KIND, LOW_KIND)
    ginv = _normalising_factor(gsq, i, mult)
    a = lr * beta1
    b = lr * (1.0 - beta1)
    w2 = tl.load(sums + 4 * i)
    r2 = tl.load(sums + 4 * i + 1)
    c2 = tl.load(sums + 4 * i + 2)
    ratio_r = tl.where(adapt > 0.0, _trust_ratio(w2, r2, lower, upper, HAS_LOWER, HAS_UPPER), 1.0)
    if MOVED:  # c' = c - wd*a*ratio_r*r: ||c'||^2 from the first phase's sums
        k = wd * a * ratio_r
        c2 = tl.maximum(c2 - 2.0 * k * tl.load(sums + 4 * i + 3) + k * k * r2, 0.0)
    ratio_c = tl.where(adapt > 0.0, _trust_ratio(w2, c2, lower, upper, HAS_LOWER, HAS_UPPER), 1.0)
    for it in tl.static_range(ITERS):
        offs = start + it * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w, g, m, v = _load_wgmv(wp, gp, mp, vp, lp, offs, mask, ginv, clip_lo, clip_hi,
                                W_SPLIT, CLIP)
        dinv = 1.0 / (tl.sqrt(v) / bc2 + eps)
        r = (m / bc1) * dinv + wd * w
        w1 = w - a * (ratio_r * r)
        if MOVED:
            c = g * dinv + wd * w1
        else:
            c = g * dinv + wd * w
        _store_w(wp, lp, offs, mask, w1 - b * (ratio_c * c), W_SPLIT, LOW_KIND)
