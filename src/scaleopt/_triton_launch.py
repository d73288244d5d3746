"""How the Triton kernels are launched, as data: per state form, the elements one program
handles (its chunk); per kernel and state form, the elements of one tile (``block``: a program
runs ``chunk // block`` tiles in turn), the warps of a program and the software-pipeline
stages. The package's table is ``triton_launch.json`` beside this module; the environment
variable ``SCALEOPT_TRITON_LAUNCH`` names another file of the same form (``tools/triton_sweep.py``
writes one, the fastest configuration of each kernel measured on a GPU).

A form's kernels share its chunk table (the sums phase writes one slot per chunk, which the
apply phase's chunks must match), so the chunk is the form's, not a kernel's. int8 moments are
handled in whole blocks of 256: a tile of ``max(1, block // 256)`` blocks, so a chunk of
``chunk // 256`` blocks where ``block`` is at least 256. The order of the additions in a
program's sums follows the tile and the warps: another table may change the norms' last bits
(two runs with one table give the same bits).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional, Tuple

from . import _format
from ._triton_layout import VECTOR

FORMS = tuple(_format.MOMENT_FORMS)
KERNELS = ("sum_squares", "lamb_sums", "lamb_apply", "lans_sums", "lans_apply", "adam_apply")
#: the package's table, and the variable that names another
DEFAULT = Path(__file__).with_name("triton_launch.json")
ENVIRON = "SCALEOPT_TRITON_LAUNCH"
WARPS = (1, 2, 4, 8, 16)


class Launch(NamedTuple):
    """One kernel's launch for one state form."""

    block: int  # elements of a tile (int8: max(1, block // 256) blocks of 256)
    warps: int  # warps of a program (32 threads each)
    stages: int  # software-pipeline stages (Triton's num_stages)


class Table(NamedTuple):
    """Chunks per form, launches per (kernel, form)."""

    chunks: Dict[str, int]
    launches: Dict[Tuple[str, str], Launch]

    def chunk(self, form: str) -> int:
        """Elements of a program's chunk (float32 and bfloat16 moments)."""
        return self.chunks[form]

    def blocks(self, form: str) -> int:
        """int8 blocks of 256 in a program's chunk."""
        launch = self.launches[(KERNELS[0], form)]  # (the same for all: :func:`check`)
        return _tile_blocks(launch.block) * (self.chunks[form] // launch.block)

    def launch(self, kernel: str, form: str) -> Launch:
        return self.launches[(kernel, form)]

    def constants(self, kernel: str, form: str) -> Dict[str, int]:
        """The kernel's compile-time sizes (``BLOCK``, ``QB``, ``ITERS``) and launch options
        (``num_warps``, ``num_stages``) for the form."""
        launch = self.launches[(kernel, form)]
        return dict(BLOCK=launch.block, QB=_tile_blocks(launch.block),
                    ITERS=self.chunks[form] // launch.block, num_warps=launch.warps,
                    num_stages=launch.stages)

    def as_dict(self) -> Dict[str, Any]:
        """The table in its file's form."""
        return {"chunks": dict(self.chunks),
                "launches": {k: {f: self.launches[(k, f)]._asdict() for f in FORMS}
                             for k in KERNELS}}


def _tile_blocks(block: int) -> int:
    return max(1, block // _format.BLOCK)


def uniform(chunk: int, block: int, warps: int = 4, stages: int = 3) -> Table:
    """One chunk and one launch for every kernel and form."""
    return check(Table({f: chunk for f in FORMS},
                       {(k, f): Launch(block, warps, stages) for k in KERNELS for f in FORMS}))


def from_dict(data: Dict[str, Any]) -> Table:
    """A table from its file's form (every form's chunk, every kernel's launch per form);
    checked (:func:`check`)."""
    try:
        chunks = {f: int(data["chunks"][f]) for f in FORMS}
        launches = {(k, f): Launch(**{n: int(v) for n, v in data["launches"][k][f].items()})
                    for k in KERNELS for f in FORMS}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"a Triton launch table needs 'chunks' for {list(FORMS)} and "
                         f"'launches' of {list(KERNELS)} for each, each with {list(Launch._fields)}"
                         f" ({type(exc).__name__}: {exc})") from None
    return check(Table(chunks, launches))


def check(table: Table) -> Table:
    """``table``, or a ValueError naming what is wrong: tiles of a power of two elements,
    chunks a multiple of 16 (``VECTOR``: every chunk starts aligned) and of every tile
    of their form, one number of int8 blocks per chunk for all of a form's kernels, warps a
    power of two up to 16, at least one stage."""
    for (kernel, form), launch in table.launches.items():
        where = f"{kernel} ({form} moments)"
        if launch.block < 1 or launch.block & (launch.block - 1):
            raise ValueError(f"{where}: block {launch.block} is not a power of two")
        if table.chunks[form] % launch.block or table.chunks[form] % VECTOR:
            raise ValueError(f"{where}: the chunk {table.chunks[form]} is not a multiple of "
                             f"{VECTOR} and of the block {launch.block}")
        if launch.warps not in WARPS or launch.stages < 1:
            raise ValueError(f"{where}: warps {launch.warps} (one of {WARPS}) and stages "
                             f"{launch.stages} (>= 1)")
    int8 = {k: _tile_blocks(table.launches[(k, "int8")].block)
            * (table.chunks["int8"] // table.launches[(k, "int8")].block) for k in KERNELS}
    if len(set(int8.values())) > 1:
        raise ValueError(f"int8 kernels must share their chunk's blocks of 256: {int8}")
    return table


def load(path: Optional[str] = None) -> Table:
    """The table in ``path``, else in the file ``SCALEOPT_TRITON_LAUNCH`` names, else the
    package's."""
    path = path or os.environ.get(ENVIRON) or str(DEFAULT)
    with open(path) as f:
        return from_dict(json.load(f))


def save(table: Table, path: str) -> None:
    Path(path).write_text(json.dumps(table.as_dict(), indent=1) + "\n")
