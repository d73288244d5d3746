"""LAMB and LANS as Triton multi-tensor kernels: the GPU fast path (``Impl.TRITON``).

A group's update is a fixed number of launches, whatever its number of tensors (per set of
tensors with the same dtypes):

* LANS only, ``sum_squares``: each chunk's sum of squares of the gradient, then ``totals``:
  each gradient's, into one float32 vector (not run where the intake's clipping computed them);
* ``sums``: float32 moments updated in place, and each chunk's partial sums written to its own
  slot (LAMB ||w||^2 and ||u||^2, LANS ||w||^2, ||r||^2, ||c||^2 and <c, r>), then one
  ``totals`` launch for the group: each tensor's totals, added in a fixed order, into one
  float32 vector. No float atomics: two runs give the same bits, however the GPU scheduled
  the programs;
* between the two, for the local shards of sharded tensors, ``scaleopt._sharding`` totals that
  vector over the shards (the one reduction between these phases: :class:`TritonStep`);
* ``apply``: each tensor's trust ratios from the totals, on the device, and the new weights
  (and a float32 master's rounded weights, or a split master's two halves). Moments stored
  in bfloat16 or 8 bits (``state_dtype``) are updated here, from the stored ones and the
  gradient as the sums phase computed them, and stored: no float32 copy of them is made.

The phases are the C kernels' (``csrc/``). The kernels compile without floating-point
contraction (:data:`COMPILE_OPTIONS`) and with correctly rounded square roots and divisions, so
each operation rounds once, as written: the compiled kernels compute what the interpreter
does, but for the order of the additions in a ``tl.sum``. Bytes moved per float32 parameter:
LAMB 24 (sums: read w, g, m, v; write m, v) + 16 (apply: read w, m, v; write w) = 40, against
28 for a fused AdamW; LANS 4 + 24 + 20 = 48 (its apply reads the gradient again). The partial
sums add 4 bytes per sum and chunk (LAMB: 8 per 4096 parameters), written once and read once.

Each launch runs one program per (tensor, chunk) pair (the chunks, tiles and warps of each
kernel: :data:`LAUNCH`). A program reads its tensor's addresses and size from int64 tables
(``tl.load(table).to(pointer)``), built once per set of storages, sizes and dtypes (keyed by ``data_ptr()``, not by tensor identity: a
DTensor's ``to_local()`` is a new tensor each step) and rebuilt only when one of them changes;
the gradients' addresses are a table of their own, since a backward may put them elsewhere at
each step (a new one is one small copy, the rest stays). The tables, and the step counters'
buffer, are kept in the group's plan (``GroupTensors.cache``, the optimizer's own: two
optimizers share nothing, and ``del opt`` frees them); a functional call keeps nothing.
The per-tensor numbers of a step (learning rate, decay, the bias corrections of its step
counter, the gradient's multiplier) go to the device in one table, from pinned memory without
a wait. Loop bounds are compile-time constants or ``while`` loops, so that the kernels run
under the interpreters of Triton 3.6 and later alike: ``TRITON_INTERPRET=1`` runs them on CPU
tensors (the suite does, to hold them to the reference); ``tools/triton_compile.py`` compiles
them for sm_80 and sm_90 and holds the PTX to these rules.

Triton is imported at the first launch, not with scaleopt.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import itertools
import math
import operator
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _compact, _ops, _format
from ._group import _PLAIN, GroupTensors, TensorOptions, GroupOptions
from ._checks import check_same_sizes
from ._compile import eager
from ._sharding import Reduction
from ._triton_layout import ADAM, PTRS, SCAL, VECTOR, WHOLE_BLOCKS
from . import _triton_launch

#: how each kernel is launched per state form: the chunk a program handles, its tiles, warps
#: and stages (``_triton_launch``: the package's table, or the file ``SCALEOPT_TRITON_LAUNCH``
#: names, read when this module is imported)
LAUNCH = _triton_launch.load()

#: launches per kernel name since the start (the tests count a step's): a counter of the
#: process, as Triton's own, not a cache
LAUNCHES: collections.Counter = collections.Counter()

#: the kernels' G_KIND and W16_KIND by dtype (``_format``)
_G_KINDS = {torch.float32: _format.GRAD_KINDS["float32"],
            torch.bfloat16: _format.GRAD_KINDS["bfloat16"],
            torch.float16: _format.GRAD_KINDS["float16"]}
_W16_KINDS = {None: _format.W16_KINDS["none"], torch.bfloat16: _format.W16_KINDS["bfloat16"],
              torch.float16: _format.W16_KINDS["float16"], torch.int16: _format.W16_KINDS["split"]}
_ROW = len(PTRS)  # int64 entries per row of ``ptrs``
_ROW_LEN = PTRS.index("row_len")
_FORMS = {code: name for name, code in _format.MOMENT_FORMS.items()}
# the step table's columns (``_triton_layout.SCAL``)
_LR, _WD, _ADAPT, _GRAD_MULT, _BC1, _BC2, _T = range(len(SCAL))
#: partial-sum slots that one program of ``totals`` adds at a time
TOTALS_LANES = 64
#: the kernels' compile options: no floating-point contraction, so that each addition and
#: multiplication rounds on its own, as written and as the interpreter runs it (``fma`` would
#: round a product and a sum once: docs/gpu.md)
COMPILE_OPTIONS = {"enable_fp_fusion": False}

#: why the kernels do not run where :func:`available` says False
NOT_INSTALLED = "Triton is not installed (pip install triton)"


def available() -> bool:
    """Whether Triton can be imported (the kernels then run on CUDA tensors, and on CPU tensors
    under ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on tensors of ``device``: CUDA, or the CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``)."""
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return device.type == "cuda"


def applies(t: GroupTensors) -> bool:
    """Whether the kernels take a group's tensors (a ``GroupTensors``): on one device where they
    run (:func:`runs_on`), plain (not a tensor subclass) and contiguous; float32 moments, or
    moments stored in bfloat16 or 8 bits (``t.stored``); a float32 weight (with, optionally,
    where its rounded bfloat16 or float16 values go) or a split master (a bfloat16 weight and
    its int16 lower halves); a float32, bfloat16 or float16 gradient on the weight's device."""
    if not available() or not t.weights:
        return False
    device = t.weights[0].device
    if not runs_on(device):
        return False
    f32, bf16 = torch.float32, torch.bfloat16
    stored = t.stored or [None] * len(t.weights)
    for w, g, m, v, w16, st in zip(t.weights, t.grads, t.exp_avgs, t.exp_avg_sqs,
                                   t.w16 or [None] * len(t.weights), stored):
        if not (all(_plain(x, device) for x in (w, g, m, v)) and _moments_fit(m, v, st)
                and g.dtype in _G_KINDS and w.dtype in (f32, bf16)):
            return False
        wanted = (torch.int16,) if w.dtype == bf16 else (None, bf16, torch.float16)
        if (None if w16 is None else w16.dtype) not in wanted or not (
                w16 is None or _plain(w16, device)):
            return False
    return True


def _plain(x: Tensor, device: torch.device) -> bool:
    """A plain (not a subclass), strided, contiguous tensor on ``device``."""
    return (type(x) in _PLAIN and x.layout == torch.strided and x.is_contiguous()
            and x.device == device)


def _moments_fit(m: Tensor, v: Tensor, st: Optional[_format.Stored]) -> bool:
    """float32 moments, or moments stored as ``st`` (a ``_format.Stored``) says: bfloat16, or
    int8 and uint8 codes with their float32 scales; a local piece that is one run of the whole
    tensor (the rounding's index, ``st.offset``)."""
    if st is None:
        return m.dtype == torch.float32 and v.dtype == torch.float32
    if st.offset is None:
        return False
    if st.form == "bfloat16":
        return m.dtype == torch.bfloat16 and v.dtype == torch.bfloat16
    return (st.form == "int8" and (m.dtype, v.dtype) == (torch.int8, torch.uint8)
            and all(s is not None and s.dtype == torch.float32 and _plain(s, m.device)
                    for s in st.scales))


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------


def _kinds(t: Any, i: int) -> Tuple[int, int, int, int, int]:
    """The kinds that choose tensor ``i``'s compiled variant of a kernel (its constants
    ``W_SPLIT``, ``G_KIND``, ``W16_KIND``, ``FORM``, ``ALIGNED``): weight (0 float32, 1 split
    master), gradient dtype, w16 dtype, the moments' form, and whether its tensors allow
    16-byte vectors, and how (:func:`_aligned`; its gradient's, checked at each step, too)."""
    w16 = t.w16[i] if t.w16 else None
    st = t.stored[i] if t.stored else None
    tensors = [t.weights[i], t.exp_avgs[i], t.exp_avg_sqs[i]] + ([] if w16 is None else [w16])
    row_len = st.row_len if st is not None and st.form == "int8" else t.weights[i].numel()
    return (int(t.weights[i].dtype == torch.bfloat16), _G_KINDS[t.grads[i].dtype],
            _W16_KINDS[None if w16 is None else w16.dtype],
            _format.MOMENT_FORMS["float32" if st is None else st.form],
            _aligned([x.data_ptr() for x in tensors], row_len,
                     st is not None and st.form == "int8"))


def _aligned(addresses: Sequence[int], length: int, int8: bool = False) -> int:
    """``ALIGNED`` for a tensor: 1 where its kernels may load and store it in 16-byte vectors
    (every address a multiple of 16 bytes and its length, the elements or an int8 row's, a
    multiple of 16), and for int8 moments whose rows are moreover whole blocks of 256,
    ``WHOLE_BLOCKS``; else 0."""
    if length % VECTOR or any(a % VECTOR for a in addresses):
        return 0
    return WHOLE_BLOCKS if int8 and length % _format.BLOCK == 0 else 1


class _Plan(NamedTuple):
    """A group's tensors as the kernels take them: per set of tensors with the same kinds, the
    kinds, the int64 tables (addresses, sizes, chunks) and the tensors' places in the group;
    each tensor's span of slots for partial sums (first slot, count), and the number of
    slots."""

    sets: List[Tuple[Tuple[int, ...], Tuple[Tensor, Tensor, Tensor], Tuple[int, ...]]]
    spans: Tensor
    slots: int


def _plan(t: GroupTensors, cache: Dict[str, Any]) -> _Plan:
    """The group's plan: the one in ``cache`` (the group's) while the tensors' signature is
    the same (:func:`_signature`: a storage freed and handed to a tensor of another size or
    dtype has another), else made: the rows of ``ptrs`` (w, m, v, w16, the tensor's place in
    the group, and for stored moments the int8 scales of m and v, the length of a row of
    blocks, where the local piece starts in the whole tensor). The gradients' addresses are
    not in it (:func:`_grad_table`)."""
    key = _signature(t, cache)
    kept = cache.get("plan")
    if kept is not None and kept[0] == key:
        return kept[1]
    n = len(t.weights)
    w16 = t.w16 or [None] * n
    stored = t.stored or [None] * n
    check_same_sizes("the Triton kernels", t.weights, t.grads, t.exp_avgs, t.exp_avg_sqs, w16)
    rows = tuple((t.weights[i].data_ptr(), t.exp_avgs[i].data_ptr(),  # PTRS
                  t.exp_avg_sqs[i].data_ptr(), 0 if w16[i] is None else w16[i].data_ptr(), i,
                  *_stored_row(stored[i])) for i in range(n))
    plan = _new_plan(tuple(_kinds(t, i) for i in range(n)), rows,
                     tuple(w.numel() for w in t.weights), t.weights[0].device)
    cache["plan"] = (key, plan)
    return plan


def _signature(t: GroupTensors, cache: Dict[str, Any]) -> tuple:
    """What a group's plan depends on, as one tuple: the addresses, dtypes and sizes of its
    tensors (the gradients' dtypes, not their addresses), the stored moments' forms and rows,
    the chunk size and the device (one pass per list; the moments' dtypes are their
    forms')."""
    ptr, dtype = Tensor.data_ptr, operator.attrgetter("dtype")
    w16 = t.w16
    if w16 is not None and all(map(operator.is_, w16, itertools.repeat(None))):
        w16 = None  # (as when none is given)
    elif w16 is not None and not any(map(operator.is_, w16, itertools.repeat(None))):
        w16 = (tuple(map(ptr, w16)), tuple(map(dtype, w16)))  # (each a pass in C)
    elif w16 is not None:
        w16 = tuple((0, None) if x is None else (x.data_ptr(), x.dtype) for x in w16)
    return (tuple(map(ptr, t.weights)), _moment_addresses(t, cache), w16,
            _stored_rows(t.stored, cache), tuple(map(Tensor.numel, t.weights)),
            tuple(map(dtype, t.weights)), tuple(map(dtype, t.grads)), LAUNCH,
            t.weights[0].device)


def _of_state_lists(cache: Dict[str, Any], name: str, lists: Tuple[List[Any], ...],
                    read: Any) -> Any:
    """``read()``, or what it gave for the same list objects last time (kept in ``cache`` as
    ``name``): the Adam state's own lists, which the optimizer gives again while none of its
    tensors was replaced (and its state tensors keep their storage)."""
    kept = cache.get(name)
    if kept is not None and all(map(operator.is_, kept[0], lists)):
        return kept[1]
    value = read()
    cache[name] = (lists, value)
    return value


def _moment_addresses(t: GroupTensors, cache: Dict[str, Any]) -> Tuple[tuple, tuple]:
    """The addresses of the moments (read again only for other lists of them)."""
    lists = (t.exp_avgs, t.exp_avg_sqs)
    return _of_state_lists(cache, "moments", lists, lambda: tuple(
        tuple(map(Tensor.data_ptr, xs)) for xs in lists))


def _grad_table(t: Any, device: torch.device, cache: Dict[str, Any]) -> "_GradTable":
    """The address of each gradient of the group (int64, on ``device``, in the group's order),
    which the kernels read a tensor's gradient from: found again in ``cache`` for the same
    addresses (a few are kept, as a step's gradients are often where an earlier step's were),
    else made (one small copy; the plan, which holds everything else, stays). A backward that
    allocates the gradients anew may put them elsewhere at each step."""
    key = (tuple(map(Tensor.data_ptr, t.grads)), device)
    tables = cache.setdefault("grad tables", collections.OrderedDict())
    table = tables.get(key)
    if table is not None:
        tables.move_to_end(key)
        return table
    check_same_sizes("the Triton kernels", t.weights, t.grads)
    table = tables[key] = _GradTable(
        _ops.to_device([torch.tensor(key[0], dtype=torch.int64)], device)[0],
        # (a pass in C: no Python work per tensor when a backward moves the gradients)
        tuple(map(operator.not_, map(operator.mod, key[0], itertools.repeat(VECTOR)))))
    while len(tables) > 8:
        tables.popitem(last=False)
    return table


class _GradTable(NamedTuple):
    """The gradients' addresses (on the device) and, per tensor, whether its gradient's
    address allows 16-byte vectors."""

    addresses: Tensor
    aligned: Tuple[bool, ...]


def _new_plan(kinds: Tuple, rows: Tuple, sizes: Tuple, device: torch.device) -> _Plan:
    """The tables of a plan: the tensors in sets by kinds; each set's chunks in the order of
    its tensors, and their slots in that order over the sets."""
    sets: Dict[Tuple[int, ...], List[int]] = {}
    for i, kind in enumerate(kinds):
        sets.setdefault(kind, []).append(i)
    spans = [(0, 0)] * len(rows)
    out, base = [], 0
    for kind, idx in sets.items():
        chunks = _chunk_table([(sizes[i], rows[i][_ROW_LEN]) for i in idx], _FORMS[kind[3]],
                              base)
        counts = collections.Counter(k for k, _, _ in chunks)
        firsts: Dict[int, int] = {}
        for k, _, slot in chunks:
            firsts[k] = min(slot, firsts.get(k, slot))
        for k, i in enumerate(idx):
            spans[i] = (firsts.get(k, base), counts[k])
        base += len(chunks)

        def table(values, width):
            return torch.tensor(values or [(0,) * width], dtype=torch.int64)[:len(values)]

        out.append((kind, (table([rows[i] for i in idx], _ROW), table([sizes[i] for i in idx], 1),
                           table(chunks, 3))))
    tables = _ops.to_device([t for _, ts in out for t in ts]
                               + [torch.tensor(spans, dtype=torch.int64)], device)
    return _Plan([(kind, tuple(tables[3 * j:3 * j + 3]), tuple(sets[kind]))
                  for j, (kind, _) in enumerate(out)], tables[-1], base)


def _chunk_table(tensors: List[Tuple[int, int]], form: str,
                 base: int) -> List[Tuple[int, int, int]]:
    """The chunk table of a set of tensors (size, length of a row of int8 blocks or 0) whose
    moments are of ``form``, one row per program: (the tensor's place in the set, where the
    chunk starts, its slot for partial sums, from ``base`` on)."""
    starts = [(k, s) for k, (n, row_len) in enumerate(tensors)
              for s in _chunk_starts(n, row_len, form)]
    return [(k, s, base + j) for j, (k, s) in enumerate(starts)]


def _stored_rows(stored: Optional[List[Any]], cache: Dict[str, Any]) -> Optional[tuple]:
    """The form and :func:`_stored_row` of each tensor's stored moments (None where none are
    stored: float32 moments; read again only for another list of them)."""
    if not stored:
        return None
    return _of_state_lists(cache, "stored", (stored,), lambda: tuple(
        (None, _NOTHING_STORED) if st is None else (st.form, _stored_row(st)) for st in stored))


def _stored_row(st: Optional[_format.Stored]) -> Tuple[int, int, int, int]:
    """The stored moments' part of a row of ``ptrs``: the int8 scales' addresses (0 for
    others), the length of a row of blocks (0 for float32 moments), the local piece's
    offset."""
    if st is None:
        return _NOTHING_STORED
    m_scale, v_scale = (0 if s is None else s.data_ptr() for s in st.scales)
    return m_scale, v_scale, st.row_len if st.form == "int8" else 0, st.offset


_NOTHING_STORED = (0, 0, 0, 0)


def _chunk_starts(n: int, row_len: int, form: str) -> range:
    """Where the chunks of a tensor of ``n`` elements start: elements, or for int8 moments
    (rows of ``row_len``) blocks of 256 (:data:`LAUNCH` says how many a chunk)."""
    if not row_len:
        return range(0, n, LAUNCH.chunk(form))
    return range(0, math.prod(_compact.grid((n // row_len, row_len))), LAUNCH.blocks(form))


def _step_table(t: GroupTensors, layer: TensorOptions, o: GroupOptions,
                device: torch.device, cache: Dict[str, Any]) -> Tensor:
    """Per tensor: lr, weight decay, adapt, gradient multiplier, the bias corrections of its
    step, and the step (float32, on ``device``). The step counters are incremented, all in one
    operation (:func:`counters`). With float learning rates and the counters on the CPU
    (float32 scalars, as in torch.optim), the table is made on the host, column by column, and
    copied from pinned memory without waiting; with ``o.capturable`` or learning rates that
    are device tensors, it is made on the device (:func:`_device_table`)."""
    steps = counters(t.steps, cache)
    steps.add_(1)
    if t.skip_if is not None:  # a skipped step leaves its counters as they were
        steps.sub_(t.skip_if.to(steps.device, torch.float32))
    lrs = layer.lrs
    one_lr = all(map(operator.is_, lrs, itertools.repeat(lrs[0])))
    on_device = o.capturable or any(torch.is_tensor(lr) and lr.device.type != "cpu"
                                    for lr in (lrs[:1] if one_lr else lrs))
    if on_device:
        table = _device_table(t, layer, o, device, steps, cache)
    else:
        table = _host_table(layer, o, steps, lrs[0] if one_lr else None, device.type == "cuda",
                            cache)
        table = table.to(device, non_blocking=True) if device.type == "cuda" else table
    if t.grad_scalars is not None:  # the gradients' multipliers, where they are (the device)
        table[:, _GRAD_MULT] = t.grad_scalars.mults.to(device, torch.float32)
    return table


def _host_table(layer: Any, o: Any, steps: Tensor, one_lr: Any, pinned: bool,
                cache: Dict[str, Any]) -> Tensor:
    """The step table made on the host (in pinned memory for a CUDA device): the constant
    columns of :func:`_template`, and the learning rates (``one_lr`` where all are that one),
    the bias corrections and the steps of the counters ``steps``. Where all tensors share the
    rate and the step (the usual case), one addition of a row to the template."""
    values = steps.tolist()
    distinct = sorted(set(values))
    bc1, bc2 = _ops.bias_corrections(distinct, o.beta1, o.beta2, o.bias_correction)
    template = _template(layer, cache)
    table = torch.empty(template.shape, dtype=torch.float32, pin_memory=pinned)
    if one_lr is not None and len(distinct) == 1:
        row = [0.0] * len(SCAL)
        row[_LR], row[_BC1], row[_BC2], row[_T] = float(one_lr), bc1[0], bc2[0], distinct[0]
        return torch.add(template, torch.tensor(row, dtype=torch.float32), out=table)
    table.copy_(template)
    table[:, _LR] = (float(one_lr) if one_lr is not None
                     else torch.tensor([float(lr) for lr in layer.lrs], dtype=torch.float32))
    at = {v: k for k, v in enumerate(distinct)}
    which = torch.tensor([at[v] for v in values])
    table[:, _BC1] = torch.tensor(bc1, dtype=torch.float32)[which]
    table[:, _BC2] = torch.tensor(bc2, dtype=torch.float32)[which]
    table[:, _T] = steps
    return table


def _template(layer: Any, cache: Dict[str, Any]) -> Tensor:
    """A step table (float32, on the CPU) whose columns of weight decays, adapt flags and
    gradients' multipliers (ones, where they are not given) are filled, the others zero: the
    one in ``cache`` for the same tuples of decays and flags (as the group's plan gives them
    while they stay the same) or the same values, else made."""
    wds, adapt = layer.weight_decays, layer.adapt
    kept = cache.get("template")
    if kept is not None and kept[0] is wds and kept[1] is adapt:  # the same tuples again
        return kept[3]
    key = (tuple(wds), tuple(map(bool, adapt)))
    if kept is not None and kept[2] == key:
        template = kept[3]
    else:
        template = torch.zeros((len(wds), len(SCAL)), dtype=torch.float32)
        template[:, _WD:_GRAD_MULT + 1] = torch.tensor(
            [(wd, float(a), 1.0) for wd, a in zip(*key)], dtype=torch.float32).reshape(-1, 3)
    # (lists may change in place: only tuples are known again by identity)
    same = isinstance(wds, tuple) and isinstance(adapt, tuple)
    cache["template"] = (wds if same else None, adapt if same else None, key, template)
    return template


def counters(steps: List[Tensor], cache: Dict[str, Any]) -> Tensor:
    """One float32 tensor whose elements are the step counters ``steps`` (0-d float32 tensors
    on one device), in order: the first time a set of counters steps here, each is made to
    point into a new buffer (``Tensor.set_``: the same tensor objects, so the optimizer's state
    keeps them, with their values), so that a step adds 1 to all of them in one operation
    instead of one per tensor. The buffer is kept in ``cache`` (the group's) with the
    counters, and found again while they are the same objects pointing into it."""
    kept = cache.get("counters")
    if (kept is not None and len(steps) == len(kept[0])
            and all(map(operator.is_, steps, kept[0]))
            and list(map(Tensor.data_ptr, steps)) == kept[2]):  # the same counters again
        return kept[1]
    buf = torch.stack([s.detach().reshape(()) for s in steps]).to(torch.float32)
    storage = buf.untyped_storage()
    for i, s in enumerate(steps):
        s.set_(storage, i, (), ())
    cache["counters"] = (list(steps), buf, list(map(Tensor.data_ptr, steps)))
    return buf


def _device_table(t: GroupTensors, layer: TensorOptions, o: GroupOptions,
                device: torch.device, steps: Tensor, cache: Dict[str, Any]) -> Tensor:
    """The step table made by device operations alone, so that a CUDA graph replays them: its
    constant columns from a table kept per set of values (made at the first step, before any
    capture), the learning rates read from their tensors, the bias corrections (in float64, as
    on the host) from the step counters."""
    floats = tuple(0.0 if torch.is_tensor(lr) else float(lr) for lr in layer.lrs)
    key = (floats, tuple(layer.weight_decays), tuple(map(bool, layer.adapt)), device)
    kept = cache.get("static")
    if kept is not None and kept[0] == key:
        static = kept[1]
    else:  # (made at the first step, before any capture)
        rows = [(lr, wd, float(a), 1.0, 1.0, 1.0, 0.0)  # SCAL's columns
                for lr, wd, a in zip(*key[:3])]
        static = _ops.to_device([torch.tensor(rows, dtype=torch.float32)], device)[0]
        cache["static"] = (key, static)
    table = static.clone()
    lrs = list(layer.lrs)
    if lrs and all(lr is lrs[0] for lr in lrs) and torch.is_tensor(lrs[0]):  # a group's lr
        table[:, _LR] = lrs[0].reshape(())
    elif all(torch.is_tensor(lr) for lr in lrs):  # per-tensor multiples of it
        table[:, _LR] = torch.stack([lr.reshape(()) for lr in lrs]).to(device, torch.float32)
    else:
        for i, lr in enumerate(lrs):
            if torch.is_tensor(lr):
                table[i, _LR].copy_(lr.reshape(()))
    steps = steps.to(torch.float64)
    if steps.device != device:  # counters on the host, learning rates on the device
        steps = _ops.to_device([steps], device)[0]
    table[:, _T] = steps
    if o.bias_correction:
        table[:, _BC1], table[:, _BC2] = _bias_corrections(steps, o.beta1, o.beta2)
    return table


def _bias_corrections(steps: Tensor, beta1: float, beta2: float) -> Tuple[Tensor, Tensor]:
    """``1 - beta1^t`` and ``sqrt(1 - beta2^t)`` of the step counts ``steps`` (float64 on the
    device, as the host computes them in double), by device operations alone."""
    return 1.0 - torch.pow(beta1, steps), (1.0 - torch.pow(beta2, steps)).sqrt()


# --------------------------------------------------------------------------------------------
# launches
# --------------------------------------------------------------------------------------------


def _launch(name: str, kinds: Tuple[int, ...], tables: Tuple[Tensor, Tensor, Tensor],
            grads: Tensor, aligned: int, **args: Any) -> None:
    """Kernel ``name`` over a set of tensors (one launch): their kinds and address tables, the
    group's gradients' addresses, and whether all of the set's tensors allow 16-byte
    vectors."""
    ptrs, sizes, chunks = tables
    if chunks.shape[0] == 0:
        return
    w_kind, g_kind, w16_kind, form, _ = kinds
    _run(name, chunks.shape[0], ptrs, grads, sizes, chunks, W_SPLIT=w_kind, G_KIND=g_kind,
         W16_KIND=w16_kind, FORM=form, ALIGNED=aligned, **LAUNCH.constants(name, _FORMS[form]),
         **args)


def _sets_aligned(plan: _Plan, grads: _GradTable, cache: Dict[str, Any]) -> Tuple[int, ...]:
    """Per set of the plan, ``ALIGNED``: its tensors' (their kinds say, :func:`_aligned`)
    where their gradients at this step allow 16-byte vectors too, else 0 (kept in ``cache``
    for the same plan and gradients' table)."""
    kept = cache.get("aligned")
    if kept is not None and kept[0] is plan and kept[1] is grads:
        return kept[2]
    flags = tuple(kinds[4] if all(map(grads.aligned.__getitem__, idx)) else 0
                  for kinds, _, idx in plan.sets)
    cache["aligned"] = (plan, grads, flags)
    return flags


@eager
def _run(name: str, programs: int, *args: Any, **kwargs: Any) -> None:
    """Launch kernel ``name`` on ``programs`` programs (every launch goes through here: the
    tests and the host-time benchmark count or stub them). Outside ``torch.compile``'s graph:
    the kernels read and write the tensors through the addresses in their tables, which the
    compiler cannot see."""
    getattr(_kernels(), name)[(programs,)](*args, **kwargs, **COMPILE_OPTIONS)
    LAUNCHES[name] += 1


def _sums(plan: _Plan, grads: _GradTable, aligned: Tuple[int, ...], width: int,
          device: torch.device, name: str, **args: Any) -> Tensor:
    """Kernel ``name`` over each set of the plan, every chunk writing ``width`` partial sums
    into its own slot, then the tensors' totals (float32, ``width`` per tensor, in the
    tensors' order) added up in a fixed order by ``totals``: the same bits on every run."""
    parts = torch.empty(width * plan.slots, dtype=torch.float32, device=device)
    for (kinds, tables, _), flag in zip(plan.sets, aligned):
        _launch(name, kinds, tables, grads.addresses, flag, parts=parts, **args)
    out = torch.empty(width * plan.spans.shape[0], dtype=torch.float32, device=device)
    _run("totals", plan.spans.shape[0], parts, plan.spans, out, S=width, R=TOTALS_LANES)
    return out


def _skip_flag(t: Any, device: torch.device, cache: Dict[str, Any]) -> Tensor:
    """The kernels' skip flag: the group's (a GradScaler's found_inf), else a zero kept in
    ``cache``."""
    if t.skip_if is not None:
        return t.skip_if.reshape(1).to(device, torch.float32)
    flag = cache.get("zero")
    if flag is None or flag.device != device:
        flag = cache["zero"] = torch.zeros(1, dtype=torch.float32, device=device)
    return flag


def _options(o: Any, clip: Any) -> Dict[str, Any]:
    lo, hi = _ops.clip_bounds(clip)
    return dict(beta2=o.beta2, one_m_b1=1.0 - o.beta1, one_m_b2=1.0 - o.beta2, eps=o.eps,
                clip_lo=float(lo), clip_hi=float(hi), CLIP=clip is not None,
                lower=o.lower_bound or 0.0, upper=o.upper_bound or 0.0,
                HAS_LOWER=o.lower_bound is not None, HAS_UPPER=o.upper_bound is not None)


class TritonStep:
    """LAMB's or LANS's launches over a group's tensors, in the phases of a step (see
    ``scaleopt._sharding``): :meth:`grad_sums` (LANS: each whole gradient's sum of squares,
    unless the intake's clipping gave them; on local shards, the sums to total), :meth:`sums`
    (the trust ratios' sums, one launch per set of tensors of the same dtypes; on local shards,
    to total) and :meth:`apply` (one launch per set)."""

    def __init__(self, name: str, per_tensor: int, t: GroupTensors, layer: TensorOptions,
                 o: GroupOptions, clip: Any, options: Dict[str, Any],
                 apply_options: Dict[str, Any]) -> None:
        self.name, self.per_tensor, self.t, self.layer, self.o = name, per_tensor, t, layer, o
        self.apply_options = apply_options
        self.count = len(t.weights)
        if not self.count:
            return
        self.device = device = t.weights[0].device
        # what is kept from step to step: the group's plan's, or nothing (a functional call)
        self.cache = cache = t.cache if t.cache is not None else {}
        self.plan, self.grads = _plan(t, cache), _grad_table(t, device, cache)
        self.aligned = _sets_aligned(self.plan, self.grads, cache)
        self.options = dict(_options(o, clip), **options)  # of both phases' launches
        self.local: Optional[Tensor] = None

    def grad_sums(self) -> Optional[Reduction]:
        if self.name != "lans" or not self.count:
            return None
        t = self.t
        sq = None if t.grad_scalars is None else t.grad_scalars.sq_sums
        if sq is not None:
            self.options["gsq"] = sq.to(self.device, torch.float32)
        elif t.grad_norms is not None:
            self.options["gsq"] = t.grad_norms.to(self.device, torch.float32).square()
        else:
            out = _sums(self.plan, self.grads, self.aligned, 1, self.device, "sum_squares")
            if t.shard_sums is None:
                self.options["gsq"] = out
            else:
                return t.shard_sums.request(out, range(self.count))
        return None

    def sums(self, grad_totals: Optional[Tensor] = None) -> Optional[Reduction]:
        if not self.count:
            return None
        if grad_totals is not None:
            self.options["gsq"] = grad_totals
        t, device = self.t, self.device
        self.options["scal"] = _step_table(t, self.layer, self.o, device, self.cache)
        self.options["skip"] = _skip_flag(t, device, self.cache)
        self.local = _sums(self.plan, self.grads, self.aligned, self.per_tensor, device,
                           f"{self.name}_sums", **self.options)
        if t.shard_sums is None:
            return None
        owners = [i for i in range(self.count) for _ in range(self.per_tensor)]
        return t.shard_sums.request(self.local, owners)

    def apply(self, totals: Optional[Tensor]) -> None:
        if not self.count:
            return
        sums = self.local if totals is None else totals
        for (kinds, tables, _), flag in zip(self.plan.sets, self.aligned):
            _launch(f"{self.name}_apply", kinds, tables, self.grads.addresses, flag, sums=sums,
                    **self.options, **self.apply_options)


def lamb_triton(t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> TritonStep:
    """LAMB on the Triton kernels: the same update as :func:`scaleopt.lamb.lamb` (``t`` a
    ``GroupTensors``, ``layer`` its ``TensorOptions``, ``o`` the ``GroupOptions``), in two
    launches per set of tensors of the same dtypes. ``t.w16`` and the gradients' deferred
    scalars as in :func:`scaleopt._native.lamb_kernel`."""
    clamp = None if t.grad_scalars is None else t.grad_scalars.clamp
    return TritonStep("lamb", 2, t, layer, o, clamp,
                      dict(MODE=_format.WEIGHT_DECAY_MODES[o.weight_decay_mode]), {})


def lans_triton(t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> TritonStep:
    """LANS on the Triton kernels: the same update as :func:`scaleopt.lans.lans` (arguments as
    in :func:`lamb_triton`), in three launches per set of tensors (two where the gradients'
    norms are known)."""
    return TritonStep("lans", 4, t, layer, o, o.clip_grad_value, {},
                      dict(MOVED=bool(o.decay_moved_weight), beta1=o.beta1))


def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], w16s: Sequence[Optional[Tensor]],
         state_steps: Sequence[Tensor], *, step_sizes: Sequence[float],
         bias_correction2_sqrts: Sequence[float], weight_decays_l2: Sequence[float],
         decays: Sequence[float], beta1: float, beta2: float, eps: float,
         grad_multipliers: Sequence[float], nesterov: bool = False,
         one_minus_betas: Optional[Tuple[float, float]] = None,
         stored: Optional[Sequence[Any]] = None,
         cache: Optional[Dict[str, Any]] = None) -> None:
    """One Adam step on each tensor on the Triton kernels (``adam_apply``: one launch per set
    of tensors of the same kinds): the C kernel's step (:func:`scaleopt._native.adam`, the
    same arguments but ``threads``), its operations in its order, so the same bits. Each
    ``state_steps[i]`` is incremented (the scalars given are those of the incremented step).
    ``cache``: a dict kept between steps for the same tensors (their address tables), or
    None."""
    if not params:
        return
    t, cache = _adam_tensors(params, grads, exp_avgs, exp_avg_sqs, w16s, state_steps, stored,
                             cache)
    for s in state_steps:
        s.add_(1)
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    bc2 = f32(list(bias_correction2_sqrts))
    columns = dict(step_size=f32(list(step_sizes)), bc2_sqrt=bc2,
                   inv_bc2_sqrt=torch.ones((), dtype=torch.float32) / bc2,  # float32, as in C
                   weight_decay_l2=f32(list(weight_decays_l2)), decay=f32(list(decays)),
                   grad_mult=f32(list(grad_multipliers)),
                   step=torch.stack([s.reshape(()).float().cpu() for s in state_steps]))
    table = torch.stack([columns[name] for name in ADAM], 1)
    _adam_launches(t, cache, _ops.to_device([table], params[0].device)[0], beta1, beta2, eps,
                   nesterov, one_minus_betas)


def adamw(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
          exp_avg_sqs: Sequence[Tensor], state_steps: Sequence[Tensor], *, lr: Any,
          weight_decays: Sequence[float], beta1: float, beta2: float, eps: float,
          stored: Optional[Sequence[Any]] = None, cache: Optional[Dict[str, Any]] = None,
          w16s: Optional[Sequence[Optional[Tensor]]] = None) -> None:
    """AdamW's step (decoupled decay ``weight_decays[i]``, bias corrections) on the Triton
    kernel, with :func:`adam`'s scalars (so the C kernel's bits) made on the host per distinct
    step count and decay rather than per tensor: the step counters (float32 scalars on the
    host) incremented in one operation (:func:`counters`), and one small table copied from
    pinned memory without waiting. ``w16s`` as in :func:`adam` (split masters' lower halves,
    or where a float32 master's rounded values go)."""
    if not params:
        return
    t, cache = _adam_tensors(params, grads, exp_avgs, exp_avg_sqs,
                             w16s or [None] * len(params), state_steps, stored, cache)
    device = params[0].device
    steps = counters(list(state_steps), cache)
    steps.add_(1)
    table = _adamw_table(steps, float(lr), weight_decays, beta1, beta2, device.type == "cuda",
                         cache)
    table = table.to(device, non_blocking=True) if device.type == "cuda" else table
    _adam_launches(t, cache, table, beta1, beta2, eps, False, None)


def _adamw_table(steps: Tensor, lr: float, weight_decays: Sequence[float], beta1: float,
                 beta2: float, pinned: bool, cache: Dict[str, Any]) -> Tensor:
    """Adam's step table (``ADAM``'s columns, float32, in pinned memory for a CUDA device)
    for AdamW at the incremented counters ``steps``: each value as :func:`adam`'s callers
    compute it (Python floats, rounded once to float32; ``inv_bc2_sqrt`` divided in
    float32), computed once per distinct step count and per distinct decay."""
    f32 = torch.float32
    key = tuple(weight_decays)
    kept = cache.get("adamw decays")
    if kept is None or kept[0] != key:
        wds = sorted(set(key))
        at = {wd: i for i, wd in enumerate(wds)}
        kept = cache["adamw decays"] = (key, wds, torch.tensor([at[wd] for wd in key]))
    _, wds, which_decay = kept
    values = steps.tolist()
    distinct = sorted(set(values))
    bc1, bc2 = _ops.bias_corrections(distinct, beta1, beta2, True)
    bc2_sqrt = torch.tensor(bc2, dtype=f32)
    columns = dict(step_size=torch.tensor([lr / b for b in bc1], dtype=f32), bc2_sqrt=bc2_sqrt,
                   inv_bc2_sqrt=torch.ones((), dtype=f32) / bc2_sqrt,
                   weight_decay_l2=torch.zeros(1, dtype=f32),
                   decay=torch.tensor([1.0 - lr * wd for wd in wds], dtype=f32)[which_decay],
                   grad_mult=torch.ones(1, dtype=f32), step=torch.tensor(distinct, dtype=f32))
    if len(distinct) > 1:  # per tensor, by its step count
        at = {v: i for i, v in enumerate(distinct)}
        which = torch.tensor([at[v] for v in values])
        for name in ("step_size", "bc2_sqrt", "inv_bc2_sqrt", "step"):
            columns[name] = columns[name][which]
    table = torch.empty((len(values), len(ADAM)), dtype=f32, pin_memory=pinned)
    for j, name in enumerate(ADAM):
        table[:, j] = columns[name]
    return table


def adamw_on_device(params: Sequence[Tensor], grads: Sequence[Tensor],
                    exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                    state_steps: Sequence[Tensor], *, lr: Any, weight_decays: Sequence[float],
                    beta1: float, beta2: float, eps: float,
                    stored: Optional[Sequence[Any]] = None,
                    cache: Optional[Dict[str, Any]] = None,
                    w16s: Optional[Sequence[Optional[Tensor]]] = None) -> None:
    """AdamW's step (decoupled decay ``weight_decays[i]``, bias corrections) on the Triton
    kernel, with its scalars made by device operations alone from the step counters (where
    the weights are; incremented there) and ``lr`` (a float, or a 0-d tensor on the weights'
    device that a scheduler may change in place): the step reads nothing on the host, so a
    CUDA graph can capture it. The scalars are :func:`adam`'s (in float64, then float32) but
    for the last bits of the powers of the betas."""
    if not params:
        return
    t, cache = _adam_tensors(params, grads, exp_avgs, exp_avg_sqs,
                             w16s or [None] * len(params), state_steps, stored, cache)
    device = params[0].device
    key = (tuple(weight_decays), device)
    kept = cache.get("adam static")
    if kept is None or kept[0] != key:  # (made at the first step, before any capture)
        kept = cache["adam static"] = (key, _ops.to_device(
            [torch.tensor(list(weight_decays), dtype=torch.float64)], device)[0])
    counts = counters(list(state_steps), cache)  # (all on the weights' device)
    counts.add_(1)
    steps = counts.to(torch.float64)
    rate = lr.reshape(()).to(torch.float64) if torch.is_tensor(lr) else float(lr)
    bc1, bc2 = _bias_corrections(steps, beta1, beta2)
    bc2 = bc2.float()
    columns = dict(step_size=(rate / bc1).float(), bc2_sqrt=bc2,
                   inv_bc2_sqrt=1.0 / bc2, weight_decay_l2=torch.zeros_like(bc2),
                   decay=(1.0 - rate * kept[1]).float(), grad_mult=torch.ones_like(bc2),
                   step=steps.float())
    _adam_launches(t, cache, torch.stack([columns[name] for name in ADAM], 1), beta1, beta2,
                   eps, False, None)


def _adam_tensors(params: Sequence[Tensor], grads: Sequence[Tensor],
                  exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
                  w16s: Sequence[Optional[Tensor]], state_steps: Sequence[Tensor],
                  stored: Optional[Sequence[Any]], cache: Optional[Dict[str, Any]]
                  ) -> Tuple[GroupTensors, Dict[str, Any]]:
    """An Adam step's tensors as the launcher takes them, and the cache (a new dict for
    None)."""
    cache = {} if cache is None else cache
    w16 = list(w16s) if any(x is not None for x in w16s) else None
    return GroupTensors(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                        list(state_steps), w16, stored=list(stored) if stored else None,
                        cache=cache), cache


def _adam_launches(t: GroupTensors, cache: Dict[str, Any], table: Tensor, beta1: float,
                   beta2: float, eps: float, nesterov: bool,
                   one_minus_betas: Optional[Tuple[float, float]]) -> None:
    """``adam_apply`` over the group's sets of tensors, with their rows of Adam's step table
    (``ADAM``, on the device)."""
    device = t.weights[0].device
    plan, grad_table = _plan(t, cache), _grad_table(t, device, cache)
    aligned = _sets_aligned(plan, grad_table, cache)
    omb1, omb2 = one_minus_betas or (1.0 - beta1, 1.0 - beta2)
    skip = _skip_flag(t, device, cache)
    for (kinds, tables, _), flag in zip(plan.sets, aligned):
        _launch("adam_apply", kinds, tables, grad_table.addresses, flag, adam=table, skip=skip,
                beta1=beta1, one_m_b1=omb1, beta2=beta2, one_m_b2=omb2, eps=eps,
                NESTEROV=bool(nesterov))


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    """The jitted kernels (Triton imported, and ``TRITON_INTERPRET`` read, at the first use):
    a module, process-wide as Triton's compiled kernels are. Everything kept from one step to
    the next for a group's tensors (plans, tables, counters) is the group's plan's
    (``GroupTensors.cache``), not the module's."""
    from . import _triton_kernels

    return _triton_kernels
