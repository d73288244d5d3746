"""Which implementation runs an update: decided in one place, :func:`implementation`.

* ``SINGLE``: the reference loop, one tensor at a time, the algorithm as written in the docs;
* ``MULTI``: torch's multi-tensor (foreach) ops, a few kernels per group (accelerators);
* ``NATIVE``: the fused C kernels (``_native``), all tensors of a group in one call, two passes
  over memory per tensor (the CPU).

All three compute the same numbers up to float round-off. The functional forms pick theirs
from a table (``lamb._IMPLEMENTATIONS``, ``lans._IMPLEMENTATIONS``): adding one is an enum
member here, a line in :func:`implementation`, and one function per optimizer.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, Optional, Sequence

import torch
from torch import Tensor

from . import _native
from ._group import GroupTensors
from ._sharding import any_dtensor


class Impl(str, enum.Enum):
    SINGLE = "single"
    MULTI = "multi"
    NATIVE = "native"

    @property
    def reads_stored(self) -> bool:
        """Whether it takes a group as stored: split masters in their two halves, the
        gradients' deferred scalars applied as it reads them, a float32 master's rounded
        weights written in its pass. The others run on float32 masters and gradients with
        their scalars applied (:meth:`GroupTensors.for_torch`)."""
        return self is Impl.NATIVE


def implementation(group: Dict[str, Any], params: Sequence[Tensor], *, kernels: bool = True,
                   on_host: bool = False, tensors: Optional[GroupTensors] = None) -> Impl:
    """The implementation of a group's update.

    ``foreach=True``/``False`` (the group's option) asks for ``MULTI``/``SINGLE``. With
    ``foreach=None``: ``NATIVE`` for an optimizer with ``kernels`` when they are built, the
    update runs in host memory (CPU parameters, or ``on_host``: an offloaded optimizer) and,
    when ``tensors`` are given, the kernels take every one of them (:func:`_native.applies`:
    contiguous float32 weights, or bfloat16 ones with master weights); without ``tensors`` the
    answer says whether the kernels may take the group (before its state exists). Otherwise
    ``MULTI`` on accelerators, where it saves kernel launches, and ``SINGLE`` on the CPU, where
    torch's foreach ops are a loop themselves. Sharded (DTensor) parameters run on their local
    shards (``tensors`` are those), ``NATIVE`` as above or else ``MULTI`` (also for
    ``foreach=False``: there is no per-tensor loop over shards). Sparse layouts always take
    ``SINGLE``.
    """
    if not all(p.layout == torch.strided for p in params):
        return Impl.SINGLE
    sharded = any_dtensor(params)
    foreach = group.get("foreach")
    if foreach is not None and not sharded:
        return Impl.MULTI if foreach else Impl.SINGLE
    if (foreach is None and kernels and _native.available()
            and (on_host or all(p.device.type == "cpu" for p in params))
            and (tensors is None or _native.applies(tensors))):
        return Impl.NATIVE
    if sharded:  # on the local shards, the norms totalled in one reduction
        return Impl.MULTI
    return Impl.MULTI if all(p.device.type != "cpu" for p in params) else Impl.SINGLE


def resolve(impl: Optional[str], foreach: bool) -> Impl:
    """A functional form's ``implementation`` argument, or its older ``foreach`` flag."""
    if impl is None:
        return Impl.MULTI if foreach else Impl.SINGLE
    try:
        return Impl(impl)
    except ValueError:
        raise ValueError(f"Invalid implementation: {impl!r} (choose one of "
                         f"{[i.value for i in Impl]})") from None

