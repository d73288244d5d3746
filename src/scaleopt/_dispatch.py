"""Which implementation runs an update: decided in one place, :func:`implementation`.

* ``SINGLE``: the reference loop, one tensor at a time, the algorithm as written in the docs;
* ``MULTI``: torch's multi-tensor (foreach) ops, a few kernels per group (accelerators);
* ``NATIVE``: the fused C kernels (``_native``), all tensors of a group in one call, two passes
  over memory per tensor (the CPU);
* ``TRITON``: Triton multi-tensor kernels (``_triton``), one launch per phase for all tensors of
  a group (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

All four compute the same numbers up to float round-off. The functional forms pick theirs
from a table (``lamb._IMPLEMENTATIONS``, ``lans._IMPLEMENTATIONS``): adding one is an enum
member here, a line in :func:`implementation` (and, for fused kernels, their test in
``_TAKES``), and one function per optimizer. An optimizer's step asks once per group:
:func:`implementation` before the group's state exists (``LayerwiseAdam._plan_step``), and
:func:`confirmed` with its tensors.
"""

from __future__ import annotations

import enum
import itertools
import operator
from typing import Any, Dict, Optional, Sequence

import torch
from torch import Tensor

from . import _native, _triton
from ._group import GroupTensors
from ._sharding import any_dtensor


class Impl(str, enum.Enum):
    SINGLE = "single"
    MULTI = "multi"
    NATIVE = "native"
    TRITON = "triton"

    def __init__(self, value: str) -> None:
        #: Whether it is one of the fused kernels (C or Triton), which take a group's tensors
        #: as the optimizer holds them: split masters in their two halves, moments in bfloat16
        #: or 8 bits, the gradients' deferred scalars applied as they read them, a float32
        #: master's rounded weights written in their pass. The others run on float32 masters
        #: and moments and gradients with their scalars applied
        #: (:meth:`GroupTensors.for_torch`). (An attribute: a step reads it per group.)
        self.fused = value in ("native", "triton")


def implementation(group: Dict[str, Any], params: Sequence[Tensor], *, kernels: bool = True,
                   on_host: bool = False, tensors: Optional[GroupTensors] = None) -> Impl:
    """The implementation of a group's update.

    ``fused=True`` (the group's option) asks for the fused kernels: ``NATIVE`` in host memory,
    ``TRITON`` on CUDA, ``ValueError`` where neither can take the group (:func:`fused`).
    ``foreach=True``/``False`` asks for ``MULTI``/``SINGLE``. ``fused=False`` leaves the fused
    kernels out of the choice below. With neither set: ``NATIVE`` for an optimizer with
    ``kernels`` when they are built, the update runs in host memory (CPU parameters, or
    ``on_host``: an offloaded optimizer) and,
    when ``tensors`` are given, the kernels take every one of them (:func:`_native.applies`:
    contiguous float32 weights, or bfloat16 ones with master weights); without ``tensors`` the
    answer says whether the kernels may take the group (before its state exists). Otherwise
    ``MULTI`` on accelerators, where it saves kernel launches, and ``SINGLE`` on the CPU, where
    torch's foreach ops are a loop themselves. Sharded (DTensor) parameters run on their local
    shards (``tensors`` are those), ``NATIVE`` as above or else ``MULTI`` (also for
    ``foreach=False``: there is no per-tensor loop over shards). Sparse layouts always take
    ``SINGLE``. With ``kernels``, ``TRITON`` where the parameters are CUDA tensors, Triton
    imports and it takes every tensor (:func:`_triton.applies`).

    A group's ``implementation`` option, when set, decides instead (the Triton kernels on CPU
    tensors under ``TRITON_INTERPRET=1``, say): ``ValueError`` where it cannot take the tensors.
    """
    if group.get("implementation") is not None:
        return _explicit(Impl(group["implementation"]), params, tensors)
    # (each test one pass in C over the parameters: a step asks more than once)
    if not all(map(operator.is_, map(_LAYOUT, params), itertools.repeat(torch.strided))):
        return Impl.SINGLE
    sharded = any_dtensor(params)
    foreach, asked = group.get("foreach"), group.get("fused")
    if asked and kernels:
        return fused(params, on_host, tensors)
    if foreach is not None and not sharded:
        return Impl.MULTI if foreach else Impl.SINGLE
    choose = kernels and _native.kernels_allowed(group)  # (fused=True returned above)
    if (choose and _native.available() and (on_host or all(map(_IS_CPU, params)))
            and (tensors is None or _native.applies(tensors))):
        return Impl.NATIVE
    if (choose and not on_host and _triton.available() and all(map(_IS_CUDA, params))
            and (tensors is None or _triton.applies(tensors))):
        return Impl.TRITON
    if sharded:  # on the local shards, the norms totalled in one reduction
        return Impl.MULTI
    return Impl.SINGLE if any(map(_IS_CPU, params)) else Impl.MULTI


_LAYOUT = operator.attrgetter("layout")
_IS_CPU = operator.attrgetter("is_cpu")
_IS_CUDA = operator.attrgetter("is_cuda")


def takes(impl: Impl, tensors: GroupTensors) -> bool:
    """Whether the fused kernels ``impl`` take a group's tensors (their state made)."""
    return _TAKES[impl][0](tensors)


def confirmed(impl: Impl, group: Dict[str, Any], params: Sequence[Tensor],
              tensors: GroupTensors, *, on_host: bool = False) -> Impl:
    """The implementation :func:`implementation` chose for a group before its state existed,
    now that its tensors are known: the fused kernels where they take every tensor, else what
    :func:`implementation` answers with the tensors (``ValueError`` where the kernels were
    asked for, the choice without them otherwise)."""
    if not impl.fused or takes(impl, tensors):
        return impl
    return implementation(group, params, on_host=on_host, tensors=tensors)


def fused(params: Sequence[Tensor], on_host: bool, tensors: Optional[GroupTensors]) -> Impl:
    """The fused kernels that ``fused=True`` asks for: ``NATIVE`` where the update runs in host
    memory, ``TRITON`` on CUDA; ``ValueError`` where they are not installed or cannot take the
    tensors (``tensors`` None: before the group's state exists, only the device is asked)."""
    if on_host or all(map(_IS_CPU, params)):
        impl, have, missing = Impl.NATIVE, _native.available(), _native.NOT_BUILT
    elif all(map(_IS_CUDA, params)):
        impl, have, missing = Impl.TRITON, _triton.available(), _triton.NOT_INSTALLED
    else:
        raise ValueError("fused=True: the fused kernels run on CPU tensors (C) or on CUDA tensors "
                         f"(Triton), not on {sorted({p.device.type for p in params})} tensors")
    if not have:
        raise ValueError(f"fused=True: {missing}")
    return _explicit(impl, params, tensors, asked="fused=True")


def check_implementation(group: Dict[str, Any]) -> None:
    """A group's ``implementation`` option: None, or an implementation this install has, not
    together with ``foreach`` or ``fused``."""
    name = group.get("implementation")
    if name is None:
        return
    impl = resolve(name, True)
    for key in ("foreach", "fused"):
        if group.get(key) is not None:
            raise ValueError(f"implementation={name!r} and {key}={group[key]!r} cannot be "
                             f"set together: implementation names the path itself")
    if impl is Impl.NATIVE and not _native.available():
        raise ValueError(f"implementation='native': {_native.NOT_BUILT}")
    if impl is Impl.TRITON and not _triton.available():
        raise ValueError(f"implementation='triton': {_triton.NOT_INSTALLED}")


def resolve(impl: Optional[str], foreach: bool) -> Impl:
    """A functional form's ``implementation`` argument, or its older ``foreach`` flag."""
    if impl is None:
        return Impl.MULTI if foreach else Impl.SINGLE
    try:
        return Impl(impl)
    except ValueError:
        raise ValueError(f"Invalid implementation: {impl!r} (choose one of "
                         f"{[i.value for i in Impl]})") from None



#: What an implementation asked for by name needs of the tensors: (test, what it takes).
_TAKES = {
    Impl.NATIVE: (_native.applies, "contiguous float32 CPU weights, moments and gradients, or "
                                   "bfloat16 ones with master weights, and the C kernels built"),
    Impl.TRITON: (_triton.applies, "plain contiguous tensors on one device: float32 or split "
                                   "bfloat16 weights, float32 moments; and Triton installed"),
}


def _explicit(impl: Impl, params: Sequence[Tensor], tensors: Optional[GroupTensors], *,
              asked: Optional[str] = None) -> Impl:
    """``impl``, asked for by a group's ``implementation`` option (or as ``asked`` says), where
    it takes the tensors."""
    if impl is Impl.SINGLE and any_dtensor(params):
        raise ValueError("implementation='single' cannot run on sharded (DTensor) parameters: "
                         "there is no per-tensor loop over shards; use 'multi'")
    test = _TAKES.get(impl)
    if test is not None and tensors is not None and not test[0](tensors):
        raise ValueError(f"{asked or f'implementation={impl.value!r}'}: the {impl.value} "
                         f"kernels cannot take this group's tensors: they take {test[1]}")
    return impl
