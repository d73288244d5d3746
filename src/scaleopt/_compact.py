"""Adam moments stored in bfloat16 or 8 bits (the ``state_dtype`` option), computed in float32.

A step reads each stored moment into a float32 working tensor (:func:`working`), the update runs
on those as on float32 state, and the new moments are stored back (:func:`store`). The stored
forms, chosen per tensor by :func:`form_for` from the group's ``state_dtype`` and the tensor's
**global** shape (never a local shard's):

* ``"float32"``: the moments as they are (tensors below :data:`MIN_NUMEL` elements always);
* ``"bfloat16"``: each value rounded to bfloat16 *stochastically*: up with probability equal
  to the distance from the value below, so the stored moment is unbiased. The random bits are a
  hash of the element's index in the whole tensor, the step and the moment, so a sharded run
  rounds every element as one process does, and a run is reproducible. (Rounding to nearest
  would freeze the second moment: ``0.999 v`` rounds back to ``v``.)
* ``"int8"``: blockwise dynamic quantization: rows along the first dimension, blocks of
  :data:`BLOCK` elements in a row, a float32 scale per block (its largest magnitude) and a
  byte per element: ``exp_avg`` as signed codes on a square-root scale, rounded to the
  nearest; ``exp_avg_sq`` as unsigned 8-bit floats, rounded stochastically. One-dimensional
  tensors (biases, norms) keep float32 state: a shard may cut them anywhere.

The formats, and why every implementation stores the same bits, are described once, in
docs/state.md ("bfloat16: stochastic rounding", "int8: blockwise dynamic quantization"); their
constants are ``_format``'s. :func:`quantize` is the reference the kernels are held to.

In a state dict an int8 moment is its codes (shaped as the parameter) and ``<key>_scale``
(float32, ``(rows, blocks)``), sharded as the parameter is (DTensors along dimension 0).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _format, _native
from ._format import Stored
from ._layout import is_run, layout
from ._sharding import cuts, is_dtensor, like, local_piece

#: the choices of ``state_dtype``
STATE_DTYPES = ("float32", "bfloat16", "int8")
#: tensors with fewer elements (in the whole tensor) keep float32 state; elements per int8
#: block (fewer where a row is shorter): ``_format``'s
MIN_NUMEL, BLOCK = _format.MIN_NUMEL, _format.BLOCK
#: the moments that may be stored compactly, and whether they take signed codes
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False,
          "momentum_buffer": True}
_SALT = _format.SALTS
_MASK32 = _format.MASK32


def scale_key(key: str) -> str:
    return f"{key}_scale"


SCALE_KEYS = tuple(scale_key(k) for k in SIGNED)


def form_for(state_dtype: str, shape: Sequence[int]) -> str:
    """How a tensor of global shape ``shape`` stores its moments under ``state_dtype``."""
    if state_dtype == "float32" or math.prod(shape) < MIN_NUMEL:
        return "float32"
    if state_dtype == "int8" and len(shape) < 2:
        return "float32"
    return state_dtype


def is_codes(x: Any) -> bool:
    """Whether ``x`` is an int8-stored moment's codes."""
    return isinstance(x, Tensor) and x.dtype in (torch.int8, torch.uint8)


def stored_form(x: Tensor, working_dtype: torch.dtype) -> str:
    """The form a stored moment is in, from its dtype (``working_dtype``: what the update
    computes in)."""
    if is_codes(x):
        return "int8"
    if x.dtype == torch.bfloat16 and working_dtype != torch.bfloat16:
        return "bfloat16"
    return "float32"


def grid(shape: Sequence[int]) -> Tuple[int, int]:
    """``(rows, blocks per row)`` of an int8-stored tensor of ``shape``: the shape of its
    scales."""
    row = math.prod(shape[1:])
    return shape[0], -(-row // BLOCK) if row else 0


# --------------------------------------------------------------------------------------------
# int8
# --------------------------------------------------------------------------------------------


def _blocks_of(x: Tensor) -> Tuple[Tensor, int]:
    """``x`` (rows first) as ``(rows, blocks, BLOCK)`` float32, the last block zero-padded; and
    the row length."""
    rows, length = x.shape[0], math.prod(x.shape[1:])
    flat = x.reshape(rows, length).float()
    blocks = -(-length // BLOCK)
    return F.pad(flat, (0, blocks * BLOCK - length)).view(rows, blocks, BLOCK), length


def quantize(x: Tensor, signed: bool, bits: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(codes, scales)`` of ``x`` (a local tensor, rows along dimension 0); ``bits``: 16
    random bits per element (:func:`code_random16`, shaped as ``x``), needed for unsigned
    codes.

    ``y = |x| c`` with ``c = 127^2/s`` (signed) or ``1.875/s`` (float32 operations).

    * Signed codes: the square root of ``y`` rounded to the nearest integer in exact
      arithmetic, halves up: ``q0 = floor(root + 0.47)`` is it or one less, and one exact
      comparison of ``(q0 + 1/2)^2`` with ``y`` decides.
    * Unsigned codes, rounded stochastically: ``z = y + 2^-31`` (rounded once), and the
      code is ``((bits(z) + 16 r) >> 20) - 768`` with ``r`` the random bits: ``z``'s top 12
      bits, one more with probability (to ``2^-16``) the fraction that the lower 20 bits
      make of a step, so ``E[decoded] = x``, and the second moment does not stay stuck on a
      code while ``beta2`` moves it by less than half a step. Codes above 255 (``y >= 2``,
      infinite ``y``) are 255.

    Every operation is exact or rounded once, so the C and Triton kernels reach the same
    codes (from other estimates of the signed codes' roots)."""
    blocks, length = _blocks_of(x)
    mags = blocks.abs()
    scales = mags.amax(dim=-1)
    factor = torch.full_like(scales, _format.SIGNED_SCALE if signed else _format.UNSIGNED_SCALE)
    factor /= scales
    y = mags * torch.where(scales > 0, factor, torch.zeros_like(scales)).unsqueeze(-1)
    if signed:
        q = y.sqrt().add_(_format.ROOT_OFFSET).floor_()
        q += (q + 0.5).square_() <= y
        q.mul_(blocks.sign())
    else:
        if bits is None:
            raise ValueError("unsigned codes are rounded stochastically: pass their random bits")
        q = _unsigned_codes(y, _blocks_of(bits.to(torch.float32))[0])
    q = q.nan_to_num_(0.0)  # a NaN moment's code is 0, as in the C kernels
    codes = q.to(torch.int8 if signed else torch.uint8)
    codes = codes.view(x.shape[0], blocks.shape[1] * BLOCK)[:, :length].reshape(x.shape)
    return codes, scales


def _unsigned_codes(y: Tensor, r: Tensor) -> Tensor:
    """The stochastically rounded 8-bit floats of ``y`` (float32, ``>= 0``) with random bits
    ``r`` (see :func:`quantize`), as float32; NaN where ``y`` is."""
    z = (y.double() + _format.CODE_LOW).float()  # exact in double, or near 2^-31: rounds to it
    bits = z.view(torch.int32).long() + r.long() * 16
    q = ((bits >> _format.CODE_SHIFT) - _format.CODE_OFFSET).clamp_(0, 255).float()
    return q.masked_fill_(y.isnan(), float("nan"))


def dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """The float32 values of ``codes`` and their ``scales`` (local tensors), contiguous."""
    if _native.takes_compact(codes, scales):
        out = torch.empty(codes.shape, dtype=torch.float32)
        _native.int8_decode(codes, scales, out)
        return out
    rows, length = codes.shape[0], math.prod(codes.shape[1:])
    flat = codes.reshape(rows, length)
    blocks = scales.shape[1]
    q = F.pad(flat.int(), (0, blocks * BLOCK - length)).view(rows, blocks, BLOCK)
    if codes.dtype == torch.int8:  # (q |q|) (s / 127^2)
        values = (q * q.abs()).float().mul_((scales / _format.SIGNED_SCALE).unsqueeze(-1))
    else:  # (F(q) - 2^-31) (s / 1.875)
        values = ((q + _format.CODE_OFFSET) << _format.CODE_SHIFT).view(torch.float32)
        values.sub_(_format.CODE_LOW).mul_((scales / _format.UNSIGNED_SCALE).unsqueeze(-1))
    return values.view(rows, blocks * BLOCK)[:, :length].contiguous().view(codes.shape)


# --------------------------------------------------------------------------------------------
# bfloat16, rounded stochastically
# --------------------------------------------------------------------------------------------


def _key(step: Any, salt: int) -> Any:
    """The rounding hash's key of a step (a number or an int64 tensor) and a moment."""
    return (step * _format.STEP_MUL + salt * _format.SALT_MUL) & _MASK32


def _hash32(index: Tensor, step: Tensor, salt: int) -> Tensor:
    """A 32-bit integer hash (int64 in ``[0, 2^32)``) of ``index`` (int64) plus the key of the
    step counter and the moment's salt, the same in every implementation."""
    key = _key(step.to(index.device, torch.int64), salt)
    x = (index + key) & _MASK32
    for _ in range(2):
        x = (((x >> 16) ^ x) * _format.HASH_MUL) & _MASK32
    return (x >> 16) ^ x


def random16(index: Tensor, step: Tensor, salt: int) -> Tensor:
    """16 random bits (int32 in ``[0, 65536)``) per element from its global ``index`` (int64),
    the step counter and the moment's salt: the lower half of :func:`_hash32`."""
    return (_hash32(index, step, salt) & 0xFFFF).to(torch.int32)


def code_random16(index: Tensor, row_len: int, step: Tensor, salt: int) -> Tensor:
    """The random bits of unsigned codes, per element of global ``index`` in rows of
    ``row_len``: at position ``p`` of its block (which starts at ``g``), positions ``p`` and
    ``p + 16`` of each 32 take the lower and upper halves of one hash, of
    ``g + 16 (p div 32) + p mod 16`` (an index inside the block, so no two pairs share one).
    One hash serves two codes."""
    p = index % row_len % BLOCK
    h = _hash32(index - p + (p >> 5 << 4) + (p & 15), step, salt)
    return torch.where(p & 16 != 0, h >> 16, h & 0xFFFF).to(torch.int32)


def round_bf16(x: Tensor, index: Tensor, step: Tensor, salt: int) -> Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically (see the module doc)."""
    bits = x.contiguous().view(torch.int32) + random16(index, step, salt)
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


def global_index(template: Tensor) -> Tensor:
    """Each element's flat index in the whole tensor (int64, shaped as the local piece): for a
    DTensor, its local shard's place in the global tensor (interleaved blocks too)."""
    piece = local_piece(template)
    lay = layout(template) if is_dtensor(template) else None
    if lay is None:
        return torch.arange(piece.numel(), device=piece.device).view(piece.shape)
    key = ("strides", piece.device)
    if key not in lay.kept:  # each dimension's indices times its stride, on the piece's device
        gshape = tuple(template.shape)
        lay.kept[key] = [
            (ix * math.prod(gshape[d + 1:])).to(piece.device).view(
                [ix.numel() if i == d else 1 for i in range(piece.dim())])
            for d, ix in enumerate(lay.index[lay.me])]
    index = torch.zeros(piece.shape, dtype=torch.int64, device=piece.device)
    for part in lay.kept[key]:
        index += part
    return index


def _held(t: Tensor) -> Optional[List[Tensor]]:
    """The global indices of ``t``'s local piece along each dimension, or None where it is
    whole here."""
    if not is_dtensor(t):
        return None
    lay = layout(t)
    return None if lay is None else lay.index[lay.me]


def _split_across_rows(t: Tensor) -> bool:
    """Whether a DTensor is split along a dimension other than the first."""
    return is_dtensor(t) and any(cuts(pl) and pl.dim != 0 for pl in t.placements)


def flat_offset(template: Tensor) -> Optional[int]:
    """Where the local piece of ``template`` starts in the whole tensor's flat order, when it
    is one run of it (a plain tensor, or one cut into blocks of whole rows); else None."""
    held = _held(template)
    if held is None:
        return 0
    if any(ix.numel() != size for ix, size in zip(held[1:], template.shape[1:])):
        return None
    rows = held[0]
    if not is_run(rows):
        return None  # interleaved blocks (FSDP2's rows of tensor parallelism's)
    return _global_offsets(template)[0] * math.prod(template.shape[1:]) if not rows.numel() \
        else int(rows[0]) * math.prod(template.shape[1:])


def _global_offsets(t: Tensor) -> Tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(offsets)


# --------------------------------------------------------------------------------------------
# the step: working tensors in, stored forms out
# --------------------------------------------------------------------------------------------


class Pending(NamedTuple):
    """A moment read into a float32 working tensor, to store back after the update."""

    state: Dict[str, Any]
    key: str
    form: str
    working: Tensor
    template: Tensor


def check_layout(template: Tensor, label: str) -> None:
    """int8 state of a sharded tensor needs it split along dimension 0 only (FSDP2's
    default), so that every block lies inside one shard."""
    if _split_across_rows(template):
        raise ValueError(f"state_dtype='int8' needs sharded tensors split along dimension 0 "
                         f"(FSDP2's default), and {label} is placed {template.placements}: "
                         f"use state_dtype='bfloat16' or shard it along dimension 0")


def new_stored(form: str, key: str, template: Tensor) -> Dict[str, Tensor]:
    """Zero state of ``form`` for a moment shaped as ``template`` (a DTensor gives DTensors)."""
    piece = local_piece(template)
    if form == "bfloat16":
        return {key: torch.zeros_like(template, dtype=torch.bfloat16,
                                      memory_format=torch.contiguous_format)}
    dtype = torch.int8 if SIGNED[key] else torch.uint8
    codes = torch.zeros_like(template, dtype=dtype, memory_format=torch.contiguous_format)
    rows, blocks = grid(tuple(template.shape))
    scales = torch.zeros(piece.shape[0], blocks, dtype=torch.float32, device=piece.device)
    return {key: codes, scale_key(key): like(template, scales, (rows, blocks))}


def read(state: Dict[str, Any], key: str, working_dtype: torch.dtype) -> Tensor:
    """The stored moment ``state[key]`` as a local tensor of ``working_dtype`` (new)."""
    x = local_piece(state[key])
    if is_codes(x):
        return dequantize(x, local_piece(state[scale_key(key)])).to(working_dtype,
                                                                     memory_format=torch.contiguous_format)
    return x.to(working_dtype, copy=True)


def write(state: Dict[str, Any], key: str, form: str, value: Tensor, template: Tensor,
          step: Tensor) -> None:
    """Store ``value`` (the local float32 moment) into ``state`` in ``form``, the stored tensors
    made anew where their form changes."""
    current = state.get(key)
    if form == "float32":
        if current is not None and current.dtype == value.dtype and not is_codes(current):
            local_piece(current).copy_(value)
        else:
            state.pop(scale_key(key), None)
            state[key] = like(template, value.clone(), template.shape)
        return
    if current is None or stored_form(current, value.dtype) != form:
        state.pop(scale_key(key), None)
        state.update(new_stored(form, key, template))
    stored = local_piece(state[key])
    if form == "bfloat16":
        offset = flat_offset(template)
        if offset is not None and _native.takes_compact(value, stored, step):
            _native.bf16_round_stochastic(value, stored, offset, _key(int(step), _SALT[key]))
        else:
            stored.copy_(round_bf16(value, global_index(template), step, _SALT[key]))
        return
    scales = local_piece(state[scale_key(key)])
    if _native.takes_compact(value, stored, scales, step):
        _native.int8_encode(value, stored, scales, flat_offset(template),
                            _key(int(step), _SALT[key]))
    else:
        bits = None if SIGNED[key] else code_random16(
            global_index(template), math.prod(template.shape[1:]), step, _SALT[key])
        codes, new_scales = quantize(value, SIGNED[key], bits)
        stored.copy_(codes)
        scales.copy_(new_scales)


def stored(state: Dict[str, Any], form: str, template: Tensor) -> Stored:
    """``exp_avg`` and ``exp_avg_sq`` of ``state`` stored in ``form`` (zeros where new), as
    :class:`Stored`."""
    for key in ("exp_avg", "exp_avg_sq"):
        if key not in state:
            state.update(new_stored(form, key, template))
    piece = local_piece(template)
    if form == "int8":
        scales = tuple(local_piece(state[scale_key(k)]) for k in ("exp_avg", "exp_avg_sq"))
        row_len = math.prod(piece.shape[1:])
    else:
        scales, row_len = (None, None), piece.numel()
    return Stored(form, state, template, scales, row_len, flat_offset(template))


def decode(item: Stored, dtype: torch.dtype, pending: List[Pending]) -> Tuple[Tensor, Tensor]:
    """The float32 working tensors of a :class:`Stored` pair of moments, for the paths that
    update float32 tensors (put on ``pending``, see :func:`working`)."""
    m, v = (working(item.state, key, item.form, item.template, dtype, pending)
            for key in ("exp_avg", "exp_avg_sq"))
    return m, v


def working(state: Dict[str, Any], key: str, form: str, template: Tensor,
            dtype: torch.dtype, pending: List[Pending]) -> Tensor:
    """The float32 working tensor of moment ``key`` stored in ``form`` (zeros where new), put
    on ``pending`` to be stored back by :func:`store`."""
    if key not in state:
        state.update(new_stored(form, key, template))
    value = read(state, key, dtype)
    pending.append(Pending(state, key, form, value, template))
    return value


def store(pending: Sequence[Pending]) -> None:
    """Store each working tensor back into its state (see :func:`working`)."""
    for item in pending:
        write(item.state, item.key, item.form, item.working, item.template, item.state["step"])


def convert(state: Dict[str, Any], form: str, template: Optional[Tensor],
            dtype: torch.dtype) -> bool:
    """Store ``state``'s moments in ``form`` where they are in another (``template``: a tensor
    laid out as the parameter, else each moment's own tensor); whether any changed."""
    changed = False
    for key in SIGNED:
        x = state.get(key)
        if x is None or stored_form(x, dtype) == form:
            continue
        write(state, key, form, read(state, key, dtype), x if template is None else template,
              state.get("step", torch.zeros(())))
        changed = True
    return changed


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------


def check_codes(st: Dict[str, Any], key: str, shape: Tuple[int, ...], where: str) -> None:
    """Raise ``ValueError`` unless the int8 moment ``st[key]`` fits a parameter whose state has
    ``shape``: codes of the right signedness shaped as it, and float32 scales, finite and
    non-negative, one per block."""
    codes, want = st[key], torch.int8 if SIGNED.get(key) else torch.uint8
    if key not in SIGNED or codes.dtype != want:
        raise ValueError(f"state {key!r} of {where}: {codes.dtype} codes, but {key!r} is stored "
                         f"as {want} codes (or as floating-point values)")
    if tuple(codes.shape) != tuple(shape) or len(shape) < 2:
        raise ValueError(f"state {key!r} of {where} holds codes of shape {tuple(codes.shape)}, "
                         f"the parameter's state {tuple(shape)}: int8 state is for tensors of "
                         f"two or more dimensions, shaped as the parameter")
    scales = st.get(scale_key(key))
    blocks = grid(shape)
    if not torch.is_tensor(scales) or scales.dtype != torch.float32 \
            or tuple(scales.shape) != blocks:
        got = (f"{scales.dtype} of shape {tuple(scales.shape)}" if torch.is_tensor(scales)
               else type(scales).__name__)
        raise ValueError(f"state {scale_key(key)!r} of {where}: the int8 codes of {key!r} need "
                         f"float32 scales of shape {blocks} (rows, blocks of {BLOCK}), got {got}")
    values = local_piece(scales.detach())
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ValueError(f"state {scale_key(key)!r} of {where} holds negative or non-finite "
                         f"scales: the checkpoint was altered or corrupted")


class SetAside(NamedTuple):
    """What :func:`set_aside` takes aside before torch's loader casts state to the parameters'
    dtypes: per parameter (in order), its compact tensors as saved; and each group's own
    ``state_dtype``."""

    tensors: List[Dict[str, Tensor]]
    state_dtypes: List[Optional[str]]


def set_aside(optimizer: Any, state_dict: Dict[str, Any]) -> SetAside:
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g.get("params", [])]
    tensors = []
    for pid in saved_ids:
        st = state_dict["state"].get(pid) or {}
        tensors.append({k: v for k, v in st.items() if torch.is_tensor(v) and (
            k in SCALE_KEYS or (k in SIGNED and (is_codes(v) or v.dtype == torch.bfloat16)))})
    return SetAside(tensors, [g.get("state_dtype") for g in optimizer.param_groups])


def put_back(optimizer: Any, aside: SetAside) -> None:
    """After torch's loader: the compact tensors as saved (on the device the loader put each
    key's tensor), each group's own ``state_dtype`` (a storage choice of this optimizer, not
    of the checkpoint), and every tensor's moments converted to the form it says, with a
    warning where any was."""
    params = [(g, p) for g in optimizer.param_groups for p in g["params"]]
    converted = 0
    for group, own in zip(optimizer.param_groups, aside.state_dtypes):
        if own is not None:
            group["state_dtype"] = own
    for (group, p), saved in zip(params, aside.tensors):
        st = optimizer.state.get(p)
        if not st:
            continue
        for key, value in saved.items():
            where = st[key].device if key in st and torch.is_tensor(st[key]) else value.device
            st[key] = value.to(where)
        if "state_dtype" not in group:
            continue
        dtype = torch.float32 if optimizer._computes_in_float32(group, p) else p.dtype
        form = form_for(group["state_dtype"], optimizer._state_shape(p))
        if form == "int8":
            check_layout(p, f"a {tuple(p.shape)} parameter")
        converted += convert(st, form, None, dtype)
    if converted:
        warnings.warn(f"{type(optimizer).__name__}.load_state_dict: the moments of {converted} "
                      f"tensor(s) were saved in another form than this optimizer's state_dtype "
                      f"says, and were converted to it (int8 and bfloat16 state round the "
                      f"values)", UserWarning, stacklevel=3)
