"""A probe of the Triton kernels' stored forms: moments stored by the kernels' own helpers and
read back, on the CPU under Triton's interpreter (tests/test_triton.py) or on a GPU
(tests/test_cuda.py). Import it after ``TRITON_INTERPRET`` is settled (conftest.py)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import scaleopt
from scaleopt import _format, _triton
from scaleopt import _triton_kernels as K
from scaleopt._triton_layout import PTRS


@triton.jit
def _store_then_load(row, grads, n, xm, xv, out_m, out_v, step, FORM: tl.constexpr,
                     BLOCK: tl.constexpr, QB: tl.constexpr, ALIGNED: tl.constexpr):
    """One tile per program (QB int8 blocks, or BLOCK elements): xm, xv stored as moments of
    FORM (``row``: a row of the address table, ``grads`` the gradients' table), then read back
    into out_m, out_v, through the kernels' own helpers (their ``ALIGNED`` variant)."""
    _, _, mp, vp, _ = K._pointers(row, grads, 0, 0, 0, FORM, ALIGNED)
    first = tl.program_id(0) * (QB if FORM == K._FORM_INT8 else BLOCK)  # a chunk of one tile
    at = K._blocks(row, n, first, QB, FORM, ALIGNED)
    offs, mask, b, bmask = K._tile(at, 0, BLOCK, QB, FORM, ALIGNED)
    K._store_moments(row, mp, vp, offs, mask, b, bmask, tl.load(xm + offs, mask=mask),
                     tl.load(xv + offs, mask=mask), tl.load(step), FORM, ALIGNED)
    # what one thread stored another may read (a block's scale; the codes, where the store's
    # layout of the tile is not the load's): the program's stores complete first (the
    # kernels themselves read moments only that an earlier launch stored)
    tl.debug_barrier()
    m, v = K._load_moments(row, mp, vp, offs, mask, b, bmask, FORM)
    tl.store(out_m + offs, m, mask=mask)
    tl.store(out_v + offs, v, mask=mask)


@triton.jit
def _placed(row, n, start, offs_out, mask_out, b_out, bmask_out, QB: tl.constexpr,
            ITERS: tl.constexpr, ALIGNED: tl.constexpr):
    """Where a program's ITERS int8 tiles of QB blocks from block ``start`` lie, as the
    kernels place them (``_blocks``, ``_tile``): each lane's offset and mask, each block's
    index and mask, tile after tile."""
    at = K._blocks(row, n, start, QB, K._FORM_INT8, ALIGNED)
    for it in tl.static_range(ITERS):
        offs, mask, b, bmask = K._tile(at, it, QB * 256, QB, K._FORM_INT8, ALIGNED)
        lanes = it * QB + tl.arange(0, QB)
        at_lanes = lanes[:, None] * 256 + tl.arange(0, 256)[None, :]
        tl.store(offs_out + at_lanes, offs)
        tl.store(mask_out + at_lanes, mask.to(tl.int8))
        tl.store(b_out + lanes, b)
        tl.store(bmask_out + lanes, bmask.to(tl.int8))


def placed_by_the_kernels(rows, row_len, start, qb, iters, aligned):
    """(offsets, masks, blocks, block masks) of the elements of ``iters`` int8 tiles of ``qb``
    blocks from block ``start`` of a tensor of ``rows`` rows of ``row_len``, as the kernels'
    ``aligned`` variant places them (on the CPU, under the interpreter): (iters * qb, 256)
    and (iters * qb,) tensors."""
    columns = dict(w=0, m=0, v=0, w16=0, index=0, m_scale=0, v_scale=0, row_len=row_len,
                   offset=0)
    row = torch.tensor([columns[name] for name in PTRS], dtype=torch.int64)
    offs = torch.full((iters * qb, 256), -1, dtype=torch.int64)
    mask = torch.zeros((iters * qb, 256), dtype=torch.int8)
    blocks = torch.full((iters * qb,), -1, dtype=torch.int32)
    bmask = torch.zeros((iters * qb,), dtype=torch.int8)
    _placed[(1,)](row, rows * row_len, start, offs, mask, blocks, bmask, QB=qb, ITERS=iters,
                  ALIGNED=aligned)
    return offs, mask.bool(), blocks, bmask.bool()


def stored_by_the_kernels(form, xm, xv, step=7.0, offset=0, qb=4, device="cpu",
                          aligned=None):
    """What the kernels store for the moments xm, xv (float32, rows first) in ``form``, and
    read back: {key: (stored, scales or None, read back)}, on the CPU; run on ``device``
    (the CPU under the interpreter, or a GPU), by the kernels' variant for the tensors'
    alignment (``_triton._aligned``) or by ``aligned``."""
    xm, xv = xm.to(device), xv.to(device)
    shape, n = xm.shape, xm.numel()
    row_len = xm[0].numel() if xm.dim() else 0
    if form == "int8":
        codes = {"exp_avg": torch.zeros(shape, dtype=torch.int8, device=device),
                 "exp_avg_sq": torch.zeros(shape, dtype=torch.uint8, device=device)}
        blocks = -(-row_len // 256)
        scales = {k: torch.full((shape[0], blocks), -1.0, device=device) for k in codes}
        tiles = -(-shape[0] * blocks // qb)
    else:
        codes = {k: torch.zeros(shape, dtype=torch.bfloat16, device=device)
                 for k in ("exp_avg", "exp_avg_sq")}
        scales = {k: torch.zeros(0, device=device) for k in codes}
        tiles = -(-n // 64)
    columns = dict(w=0, m=codes["exp_avg"].data_ptr(), v=codes["exp_avg_sq"].data_ptr(), w16=0,
                   index=0, m_scale=scales["exp_avg"].data_ptr(),
                   v_scale=scales["exp_avg_sq"].data_ptr(),
                   row_len=row_len if form == "int8" else 0, offset=offset)
    row = torch.tensor([columns[name] for name in PTRS], dtype=torch.int64, device=device)
    no_grads = torch.zeros(1, dtype=torch.int64, device=device)
    back = {k: torch.zeros(shape, device=device) for k in codes}
    if aligned is None:
        aligned = _triton._aligned([c.data_ptr() for c in codes.values()],
                                   row_len if form == "int8" else n, form == "int8")
    _store_then_load[(tiles,)](row, no_grads, n, xm.contiguous(), xv.contiguous(), back["exp_avg"],
                               back["exp_avg_sq"], torch.tensor([step], device=device),
                               FORM=_format.MOMENT_FORMS[form], BLOCK=64, QB=qb, ALIGNED=aligned,
                               **_triton.COMPILE_OPTIONS)
    return {k: (codes[k].cpu(), scales[k].cpu() if form == "int8" else None, back[k].cpu())
            for k in codes}


def exact_codes(x, signed, step=1.0):
    """The codes of x (one block of 256 per row) by their definition, in exact arithmetic
    (tests/test_state_dtype.py), with the random bits of step ``step``: what every
    implementation must store."""
    from test_state_dtype import _bits, _exact_code

    bits = _bits(x, step=step).tolist()
    return [[_exact_code(abs(v), signed, r) * (-1 if v < 0 else 1) for v, r in zip(row, rb)]
            for row, rb in zip(x.tolist(), bits)]


def first_phase_sums(cls, decoupled, device, monkeypatch):
    """Three Triton steps of LAMB or LANS (float32 state; LAMB's decay in the "update" or the
    "decoupled" mode) on three tensors of ``device``: the last step's totalled first-phase
    sums as the kernels gave them, and as float64 computes them from the weights before the
    step and the moments it stored (LAMB: ||w||^2, ||u||^2; LANS: ||w||^2, ||r||^2, ||c||^2,
    <r, c>)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, device=device))
              for s in ((33, 7), (64,), (5, 9, 4))]
    kw = dict(weight_decay_mode="decoupled") if decoupled else {}
    opt = cls(params, lr=1e-2, weight_decay=0.01, implementation="triton", **kw)
    totalled, run = [], _triton._run

    def recorded(name, programs, *args, **kwargs):
        run(name, programs, *args, **kwargs)
        if name == "totals" and kwargs["S"] > 1:  # (LANS: also the gradients' norms, S 1)
            totalled.append(args[2].clone())
    monkeypatch.setattr(_triton, "_run", recorded)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * (step + 1)
        before = [p.detach().double() for p in params]
        opt.step()
    g = opt.param_groups[0]
    beta1, beta2 = g["betas"]
    bc1, bc2, wd = 1 - beta1 ** 3, math.sqrt(1 - beta2 ** 3), g["weight_decay"]
    want = []
    for p, w in zip(params, before):
        m, v = (opt.state[p][k].double() for k in ("exp_avg", "exp_avg_sq"))
        dinv = 1 / ((v.sqrt() / bc2) + g["eps"])
        if cls is scaleopt.LANS:
            gn = p.grad.double() / p.grad.double().norm()
            r, c = m / bc1 * dinv + wd * w, gn * dinv + wd * w
            want += [w.square().sum(), r.square().sum(), c.square().sum(), (r * c).sum()]
        else:
            if decoupled:
                w = w * (1 - g["lr"] * wd)
            u = m / bc1 * dinv + (0 if decoupled else wd * w)
            want += [w.square().sum(), u.square().sum()]
    assert len(totalled) == 3
    return totalled[-1].double().cpu(), torch.stack(want).cpu()
