"""Muon's orthogonalization: the Newton-Schulz iteration, on whole matrices also when FSDP2,
HSDP, tensor or expert parallelism shard them.

:func:`newton_schulz` is ``torch.optim.Muon``'s iteration operation for operation (bfloat16,
the quintic polynomial, the norm clamped at ``eps``), so its results are torch's bits.

The iteration needs a whole matrix, and FSDP2 gives each rank some rows of it (``Shard(0)``).
:func:`orthogonalize` gives each sharded matrix to one rank of the process group that shards
it (:func:`owners`: the largest first, each to the rank with the least work so far, by the
iteration's cost), and moves the rows in one batched ``all_to_all_single`` per process group
and direction: every rank sends its rows of each matrix to the matrix's owner, each owner
stacks the rows in rank order (the whole matrix, as one process holds it), iterates, and sends
each rank its rows of the result. The rows travel in the iteration's dtype (bfloat16 by
default, as torch's): the iteration's own first rounding, so the exchange halves the bytes
and changes no bit, and a sharded step's results are one process's. Matrices that nothing
shards are iterated where they are.

On HSDP (``(Replicate(), Shard(0))``: R replicas of the same S row blocks) every replica holds
the same momentum, so a matrix is iterated once in the whole mesh: the owners are chosen among
all R x S ranks, each replica's shard group exchanges only the rows of the matrices its own
ranks iterate (a replica that owns none of them sends nothing), and one ``all_gather`` over
the replicas (each rank with the ranks that hold its rows elsewhere) gives every rank its rows
of the others' results: three collectives per step where one replica alone would take two,
about 1/R of the bytes through the first two, and 1/(R x S) of the iteration on each rank
instead of 1/S.

Every other placement that cuts a matrix into blocks is joined the same way, from where each
element lies (:mod:`._layout`: for each rank of the ranks that cut it, the global indices it
holds along each dimension): tensor parallelism's ``Shard(0)`` and ``Shard(1)``, FSDP x TP
over two mesh dimensions (one process group over both), FSDP2's interleaved
``_StridedShard``, each under HSDP's ``Replicate()``. A stack of matrices (a mixture of
experts' ``[experts, in, out]``) is exchanged one matrix at a time, each with its owner; a
matrix that lies whole on one rank is owned there (or by a replica of it), and a run in which
no block leaves its rank takes no all-to-all. With ``buckets`` > 1 the matrices go in runs of
about equal cost whose all-to-alls are asynchronous, one run's blocks travelling while the run
before is iterated (:class:`_Runs`). The iteration's coefficients are one triple, one per step,
or a named iteration (:data:`NS_METHODS`, :func:`polar_express`).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._layout import Layout, block_index, layout

#: torch.optim.Muon's defaults (Keller Jordan's constants)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


#: the named iterations that ``ns_coefficients`` may give instead of numbers: torch's fixed
#: quintic (the default's coefficients at every step) and Polar Express's per-step ones
NS_METHODS = ("quintic", "polar_express")

Coefficients = Tuple[float, float, float]


def _optimal_quintic(low: float, high: float) -> Coefficients:
    """The odd quintic ``p(x) = a x + b x^3 + c x^5`` nearest to 1 on ``[low, high]`` in the
    largest error: its error equioscillates at ``low``, the two inner extrema and ``high``
    (Remez's exchange, in float64, from the points that are exact as ``low -> high``)."""
    if low / high >= 1 - 5e-6:  # the interval is a point: p(x) = 1 there, flat to 2nd order
        return (15 / 8) / high, (-10 / 8) / high ** 3, (3 / 8) / high ** 5
    q, r = (3 * low + high) / 4, (low + 3 * high) / 4
    error, last = math.inf, None
    for _ in range(100):
        if last is not None and abs(last - error) <= 1e-15:
            break
        last = error
        points = torch.tensor([low, q, r, high], dtype=torch.float64)
        system = torch.stack([points, points ** 3, points ** 5,
                              torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)], 1)
        a, b, c, error = torch.linalg.solve(system, torch.ones(4, dtype=torch.float64)).tolist()
        root = math.sqrt(9 * b * b - 20 * a * c)  # p'(x) = a + 3 b x^2 + 5 c x^4 = 0
        q, r = math.sqrt((-3 * b - root) / (10 * c)), math.sqrt((-3 * b + root) / (10 * c))
    return a, b, c


@functools.lru_cache(maxsize=None)
def polar_express(steps: int, low: float = 1e-3, cushion: float = 0.02407327424182761,
                  safety: float = 0.01) -> Tuple[Coefficients, ...]:
    """Polar Express's coefficients for ``steps`` steps (Amsel, Persson, Musco and Gower, 2025,
    https://arxiv.org/abs/2505.16932): at each step the odd quintic nearest to 1 in the largest
    error on the interval ``[l, u]`` where the singular values lie (``[low, 1]`` at first, after
    the normalization), found on ``[max(l, cushion u), u]`` (a polynomial for tiny ``l`` would
    amplify bfloat16's rounding), scaled so that ``p(l)`` and ``p(u)`` are equally far from 1,
    and made safe for singular values up to ``1 + safety`` (``p(x / (1 + safety))``); the next
    interval is ``[p(l), 2 - p(l)]``. Computed once per number of steps, in float64."""
    u = 1.0
    out = []
    for _ in range(steps):
        a, b, c = _optimal_quintic(max(low, cushion * u), u)
        at_low = a * low + b * low ** 3 + c * low ** 5
        at_high = a * u + b * u ** 3 + c * u ** 5
        scale = 2 / (at_low + at_high)
        s = 1 + safety
        a, b, c = a * scale / s, b * scale / s ** 3, c * scale / s ** 5
        out.append((a, b, c))
        low = a * low + b * low ** 3 + c * low ** 5
        u = 2 - low
    return tuple(out)


def step_coefficients(coefficients: Any, steps: int) -> List[Coefficients]:
    """The ``(a, b, c)`` of each of ``steps`` steps from ``ns_coefficients``: a named iteration
    (:data:`NS_METHODS`), one triple for every step, or a triple per step (the last one
    repeated where there are fewer than ``steps``)."""
    if isinstance(coefficients, str):
        if coefficients == "polar_express":
            return list(polar_express(steps))
        return [NS_COEFFICIENTS] * steps
    if not isinstance(coefficients[0], (tuple, list)):
        return [tuple(coefficients)] * steps
    per_step = [tuple(c) for c in coefficients]
    return per_step[:steps] + per_step[-1:] * max(0, steps - len(per_step))


def newton_schulz(x: Tensor, coefficients: Any, steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The quintic Newton-Schulz iteration of the 2-D ``x``, in ``dtype`` (a new tensor, of
    ``x``'s shape): ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on the wide orientation,
    after ``X / max(||X||_F, eps)``; ``(a, b, c)`` the same at every step or each step's
    (:func:`step_coefficients`)."""
    return newton_schulz_(x.to(dtype, copy=True), coefficients, steps, eps)


def newton_schulz_(y: Tensor, coefficients: Any, steps: int, eps: float) -> Tensor:
    """:func:`newton_schulz` of ``y``, in its dtype, which it takes over (normalizes in place
    and lets go of): the caller keeps no copy, so that the iteration holds, beside the
    result, one m x m buffer at a time."""
    tall = y.size(0) > y.size(1)
    if tall:
        y = y.T
    y.div_(y.norm().clamp(min=eps))
    for a, b, c in step_coefficients(coefficients, steps):
        gram = y @ y.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        del gram
        y = torch.addmm(y, poly, y, beta=a)
        del poly
    return y.T if tall else y


def cost(shape: Sequence[int]) -> int:
    """The iteration's work on a matrix of ``shape``, up to a constant (its matrix products)."""
    m, n = shape
    return m * n * min(m, n)


def owners(shapes: Sequence[Sequence[int]], ranks: int,
           allowed: Optional[Sequence[Optional[Sequence[int]]]] = None,
           speeds: Optional[Sequence[float]] = None) -> List[int]:
    """The rank that iterates each matrix: the costliest first, each to the rank that would
    finish it first (the least work so far, each rank's work its cost times its measured
    seconds per unit of cost, ``speeds``, where given; the lowest such rank), among
    ``allowed[j]`` where that is given (the ranks that hold the whole matrix already); the
    same answer on every rank."""
    load = [0.0] * ranks
    pace = list(speeds) if speeds is not None else [1.0] * ranks
    owner = [0] * len(shapes)
    for j in sorted(range(len(shapes)), key=lambda j: (-cost(shapes[j]), j)):
        among = allowed[j] if allowed is not None and allowed[j] else range(ranks)
        work = cost(shapes[j])
        r = min(among, key=lambda k: (load[k] + work * pace[k], k))
        owner[j] = r
        load[r] += work * pace[r]
    return owner


#: the exchanges timed before the ranks' paces are shared (``balance="measured"``): the first
#: is left out (it makes the buffers), the next ones summed
TIMED_EXCHANGES = (1, 3)
#: per (process group, replicas), for the callers that keep none: this rank's seconds and
#: cost iterated in the timed exchanges, and once shared, every rank's seconds per unit of cost
_PACES: Dict[Any, Dict[str, Any]] = {}


class Job:
    """One parameter's matrices to orthogonalize: the parameter (for its layout), how it is
    read (``"matrix"``, ``"stack"`` of matrices over its leading dimensions, or ``"flatten"``ed
    to one), its local piece of what to iterate, and, once done, its local piece of the
    result."""

    __slots__ = ("param", "local", "reading", "result")

    def __init__(self, param: Tensor, local: Tensor, reading: str = "matrix") -> None:
        self.param, self.local, self.reading, self.result = param, local, reading, None


def orthogonalize(jobs: Sequence[Job], coefficients: Any, steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16, buckets: int = 1,
                  balance: str = "cost", timings: Optional[Dict[Any, Any]] = None) -> None:
    """Each job's ``result``: the local piece of the iteration (in ``dtype``) of its whole
    matrices (see the module doc); one exchange each way per process group that cuts any of
    them, or with ``buckets`` > 1 that many, overlapped with the iteration. The owners share
    the work by the iteration's cost, or (``balance="measured"``) by it times each rank's
    measured pace (:data:`TIMED_EXCHANGES`), kept in ``timings`` (the caller's, per process
    group: ``timings[(group, replicas)]["paces"]``, by slot, once shared)."""
    iteration = functools.partial(newton_schulz, coefficients=coefficients, steps=steps,
                                  eps=eps, dtype=dtype)
    by_group: Dict[Any, List[Tuple[Job, Layout]]] = {}
    for job in jobs:
        lay = layout(job.param)
        if lay is None:
            job.result = iteration(job.local.reshape(_matrix(job.reading, job.local.shape))
                                   ).view(job.local.shape)
        else:
            by_group.setdefault((lay.group, lay.replicas), []).append((job, lay))
    for (group, replicas), members in by_group.items():
        _exchange(group, replicas, members, iteration, dtype, buckets, balance,
                  _PACES if timings is None else timings)


def whole_here(p: Tensor) -> bool:
    """Whether ``p`` is iterated where it is, with no exchange: nothing splits it over more
    than one rank. Such a matrix's update is made, applied and freed before the next one's is
    made, so that a step holds one update at a time."""
    return layout(p) is None


def stack_whole_here(p: Tensor) -> bool:
    """Whether each matrix of the stack ``p`` lies whole on one rank, with no copy elsewhere
    (expert parallelism's or FSDP2's cut of its leading dimensions alone): iterated where it
    lies, with no exchange."""
    lay = layout(p)
    if lay is None:
        return True
    if lay.replicas is not None:
        return False
    return all(ix.numel() == size for k in range(lay.ranks)
               for ix, size in zip(lay.index[k][-2:], p.shape[-2:]))


def _matrix(reading: str, shape: Sequence[int]) -> Tuple[int, int]:
    """The matrix a tensor of ``shape`` (a whole unit of an exchange) is iterated as."""
    if len(shape) == 2:
        return shape[0], shape[1]
    return shape[0], math.prod(shape[1:])


class _Unit:
    """One matrix of an exchange: its job, where it lies in the job's local piece (``at``: its
    leading positions in a stack, ``()`` for the whole piece, None where this rank holds none
    of it), the shape it is joined in, the matrix it is iterated as, and each rank's block of
    it (per dimension of the joined shape, the indices; None where the rank holds none)."""

    __slots__ = ("job", "at", "shape", "matrix", "blocks", "sizes")

    def __init__(self, job: int, at: Any, shape: Tuple[int, ...], matrix: Tuple[int, int],
                 blocks: List[Any]) -> None:
        self.job, self.at, self.shape, self.matrix, self.blocks = job, at, shape, matrix, blocks
        self.sizes = [0 if b is None else math.prod(ix.numel() for ix in b) for b in blocks]

    def holder(self) -> Optional[int]:
        """The rank that holds the whole matrix, if one does."""
        whole = math.prod(self.shape)
        return next((k for k, n in enumerate(self.sizes) if n == whole and whole), None)


def _units(j: int, job: Job, lay: Layout) -> List[_Unit]:
    """The matrices of job ``j``: a stack's each, else its whole tensor (made once per
    layout, reading and position in the exchange)."""
    key = ("units", j, job.reading, tuple(job.param.shape))
    if key not in lay.kept:
        lay.kept[key] = _units_of(j, job, lay)
    return lay.kept[key]


def _units_of(j: int, job: Job, lay: Layout) -> List[_Unit]:
    shape = tuple(job.param.shape)
    ranks = lay.ranks
    if job.reading != "stack" or len(shape) == 2:
        blocks = [lay.index[k] for k in range(ranks)]
        unit = _Unit(j, (), shape, _matrix(job.reading, shape), blocks)
        if not unit.sizes[lay.me]:
            unit.at = None
        return [unit]
    lead = len(shape) - 2
    where = [[{int(g): i for i, g in enumerate(lay.index[k][d])} for d in range(lead)]
             for k in range(ranks)]
    units = []
    for e in itertools.product(*(range(s) for s in shape[:lead])):
        at = [tuple(where[k][d].get(e[d]) for d in range(lead)) for k in range(ranks)]
        blocks = [None if None in at[k] else lay.index[k][lead:] for k in range(ranks)]
        unit = _Unit(j, at[lay.me], shape[lead:], shape[lead:], blocks)
        if not unit.sizes[lay.me]:
            unit.at = None
        units.append(unit)
    return units


def _exchange(group: Any, replicas: Any, members: Sequence[Tuple[Job, Layout]],
              iteration: Callable[[Tensor], Tensor], dtype: torch.dtype,
              buckets: int = 1, balance: str = "cost",
              timings: Optional[Dict[Any, Any]] = None) -> None:
    """The results of ``members``' jobs (see the module doc), all cut over ``group``, and
    copied over ``replicas`` (or None)."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    copies, copy = ((dist.get_world_size(replicas), dist.get_rank(replicas))
                    if replicas is not None else (1, 0))
    jobs = [job for job, _ in members]
    for job, lay in members:
        if tuple(job.local.shape) != tuple(ix.numel() for ix in lay.index[me]):
            raise NotImplementedError(
                f"Muon expects the local shard of a {tuple(job.param.shape)} parameter placed "
                f"{job.param.placements} to be DTensor's block of "
                f"{tuple(ix.numel() for ix in lay.index[me])}, and it is "
                f"{tuple(job.local.shape)}")
    units = [u for j, (job, lay) in enumerate(members) for u in _units(j, job, lay)]
    for job in jobs:
        job.result = (None if job.reading != "stack" or job.param.ndim == 2 else
                      torch.empty(job.local.shape, dtype=dtype, device=job.local.device))
    # the runs of the exchange (one unless buckets > 1), by the iteration's cost, and in each
    # run the owners (slot // ranks: the replica, slot % ranks: its rank), so that every rank
    # has about its share of each run's work; a matrix whole on one rank stays on it
    runs = buckets_of([cost(u.matrix) for u in units], buckets)
    timing = (_PACES if timings is None else timings).setdefault((group, replicas), dict(exchanges=0, seconds=0.0, cost=0,
                                                        paces=None))
    slot = _slots(units, runs, ranks, copies,
                  timing["paces"] if balance == "measured" else None)
    ours = [[u for u in run if slot[u] // ranks == copy] for run in runs]
    timed = (balance == "measured" and timing["paces"] is None
             and TIMED_EXCHANGES[0] <= timing["exchanges"] < TIMED_EXCHANGES[1])
    seconds = _iterate_ours(jobs, units, [o % ranks for o in slot], ours, group, iteration,
                            dtype, jobs[0].local.device, timed)
    if balance == "measured" and timing["paces"] is None:
        timing["exchanges"] += 1
        if timed:
            timing["seconds"] += seconds
            timing["cost"] += sum(cost(units[u].matrix) for run in ours for u in run
                                  if slot[u] % ranks == me)
        if timing["exchanges"] == TIMED_EXCHANGES[1]:
            timing["paces"] = _share_paces(timing, group, replicas, copies,
                                           jobs[0].local.device)
    if copies > 1:
        _share_results(jobs, units, [slot[u] // ranks for u in range(len(units))], replicas,
                       copy, dtype)


def _slots(units: Sequence[_Unit], runs: List[List[int]], ranks: int, copies: int,
           speeds: Optional[List[float]]) -> List[int]:
    """Each matrix's owner in each run, as a slot (replica x ranks + rank): a matrix that lies
    whole on one rank goes to that rank of one replica."""
    slot = [0] * len(units)
    for run in runs:
        holders = [units[u].holder() for u in run]
        allowed = [None if h is None else [c * ranks + h for c in range(copies)]
                   for h in holders]
        for u, o in zip(run, owners([units[u].matrix for u in run], copies * ranks, allowed,
                                    speeds)):
            slot[u] = o
    return slot


def _share_paces(timing: Dict[str, Any], group: Any, replicas: Any, copies: int,
                 device: torch.device) -> List[float]:
    """Every rank's seconds per unit of cost (by slot), from each rank's timed exchanges: one
    all-gather over ``group`` and one over ``replicas``. A rank that iterated nothing takes
    the others' mean pace."""
    ranks = dist.get_world_size(group)
    mine = timing["seconds"] / timing["cost"] if timing["cost"] else float("nan")
    here = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(ranks)]
    dist.all_gather(here, torch.tensor([mine], dtype=torch.float64, device=device), group=group)
    row = torch.cat(here)
    rows = [row]
    if copies > 1:
        rows = [torch.empty_like(row) for _ in range(copies)]
        dist.all_gather(rows, row, group=replicas)
    every = torch.cat(rows).cpu()
    known = every[~every.isnan()]
    fill = float(known.mean()) if known.numel() else 1.0
    return [fill if v != v else float(v) for v in every.tolist()]


def buckets_of(sizes: Sequence[int], buckets: int) -> List[List[int]]:
    """The jobs (by index, in order) cut into up to ``buckets`` runs of about equal total size
    (``sizes``: each job's, e.g. its :func:`cost`); no run empty. The same on every rank."""
    total, runs, run, filled = sum(sizes), [], [], 0
    for j, size in enumerate(sizes):
        run.append(j)
        filled += size
        if filled * buckets >= total * (len(runs) + 1) and len(runs) < buckets - 1:
            runs.append(run)
            run = []
    return runs + [run] if run else runs


def _iterate_ours(jobs: Sequence[Job], units: Sequence[_Unit], owner: Sequence[int],
                  runs: List[List[int]], group: Any, iteration: Callable[[Tensor], Tensor],
                  dtype: torch.dtype, device: torch.device, timed: bool = False) -> float:
    """The results (this rank's blocks) of the matrices of ``runs``: each matrix iterated by
    the rank ``owner[u]`` of ``group``, to which the blocks travel in an all-to-all and from
    which they come back in another. The owner joins the blocks into the matrix one process
    holds (contiguous) and cuts the result the same way.

    Each run's exchanges are asynchronous: the next run's blocks travel while this one's
    matrices are iterated, and each run's results go back while the next ones are iterated, so
    that with several runs the exchange hides behind the iteration (the same matrices, the same
    bits). One run: two all-to-alls (both empty where it has no matrices: every rank of
    ``group`` takes part); none where every matrix of the run lies whole on its owner.
    Returns the seconds this rank spent iterating where ``timed`` (else 0)."""
    exchange = _Runs(jobs, units, owner, group, dtype, device, timed)
    runs = runs or [[]]
    posted = exchange.send(runs[0])
    returning = []
    for r in range(len(runs)):
        this = posted
        if r + 1 < len(runs):
            posted = exchange.send(runs[r + 1])
        returning.append(exchange.iterate(this, iteration))
    for back in returning:
        exchange.receive(back)
    return exchange.seconds


class _Done:
    """A collective that did not need to run: nothing crosses ranks."""

    def wait(self) -> None:
        return None


class _Runs:
    """The exchange of :func:`_iterate_ours`, run by run: what every run shares (the jobs and
    their matrices, who owns each, the process group)."""

    def __init__(self, jobs: Sequence[Job], units: Sequence[_Unit], owner: Sequence[int],
                 group: Any, dtype: torch.dtype, device: torch.device,
                 timed: bool = False) -> None:
        self.jobs, self.units, self.owner = jobs, units, owner
        self.group, self.dtype, self.device = group, dtype, device
        self.ranks, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.timed, self.seconds = timed, 0.0

    def _all_to_all(self, send: Tensor, receive_sizes: List[int], send_sizes: List[int],
                    moves: bool) -> Tuple[Tensor, Any]:
        if not moves:  # every block stays where it is: this rank's to itself
            return send, _Done()
        received = torch.empty(sum(receive_sizes), dtype=self.dtype, device=self.device)
        return received, dist.all_to_all_single(
            received, send, output_split_sizes=receive_sizes, input_split_sizes=send_sizes,
            group=self.group, async_op=True)

    def _moves(self, run: List[int]) -> bool:
        """Whether any block of the run lies on a rank other than its matrix's owner (the
        same answer on every rank of the group)."""
        return any(n for u in run for k, n in enumerate(self.units[u].sizes)
                   if k != self.owner[u])

    def _mine(self, u: int) -> Tensor:
        unit = self.units[u]
        local = self.jobs[unit.job].local
        return local[unit.at] if unit.at else local

    def send(self, run: List[int]) -> Tuple[Any, ...]:
        """The run's blocks on their way to their owners (asynchronously)."""
        mine = [u for u in run if self.owner[u] == self.me]
        send = [[self._mine(u).to(self.dtype).reshape(-1) for u in run
                 if self.owner[u] == k and self.units[u].at is not None]
                for k in range(self.ranks)]
        sent = [sum(t.numel() for t in pieces) for pieces in send]
        taken = [sum(self.units[u].sizes[k] for u in mine) for k in range(self.ranks)]
        flat = _flat(send, self.device, self.dtype)
        moves = self._moves(run)
        return (run, mine, sent, taken, moves, flat) + self._all_to_all(flat, taken, sent,
                                                                        moves)

    def iterate(self, posted: Tuple[Any, ...], iteration: Callable[[Tensor], Tensor]
                ) -> Tuple[Any, ...]:
        """Once a run's blocks are here: this rank's matrices joined and iterated, and the
        results' blocks on their way back (asynchronously)."""
        run, mine, sent, taken, moves, _, got, work = posted
        work.wait()
        from_rank = [piece.split([self.units[u].sizes[k] for u in mine])
                     for k, piece in enumerate(got.split(taken))]
        back: List[List[Tensor]] = [[] for _ in range(self.ranks)]
        for i, u in enumerate(mine):
            unit = self.units[u]
            where = [None if b is None or not n else block_index(b)
                     for b, n in zip(unit.blocks, unit.sizes)]
            whole = torch.empty(unit.shape, dtype=self.dtype, device=self.device)
            for k, at in enumerate(where):
                if at is not None:
                    whole[at] = from_rank[k][i].view([ix.numel() for ix in unit.blocks[k]])
            result = self._iterate(iteration, whole.view(unit.matrix)).view(unit.shape)
            del whole
            for k, at in enumerate(where):
                if at is not None:
                    back[k].append(result[at].reshape(-1))
        flat = _flat(back, self.device, self.dtype)
        return (run, sent, flat) + self._all_to_all(flat, sent, taken, moves)

    def _iterate(self, iteration: Callable[[Tensor], Tensor], matrix: Tensor) -> Tensor:
        """``iteration(matrix)``, its seconds added to :attr:`seconds` where timed (on an
        accelerator, synchronized around it)."""
        if not self.timed:
            return iteration(matrix)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = iteration(matrix)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        return out

    def receive(self, returning: Tuple[Any, ...]) -> None:
        """Once a run's results are back: each matrix's block put in its job's ``result``."""
        run, sent, _, returned, work = returning
        work.wait()
        held = [[u for u in run if self.owner[u] == k and self.units[u].at is not None]
                for k in range(self.ranks)]
        for k, piece in enumerate(returned.split(sent)):
            for u, block in zip(held[k], piece.split([self.units[u].sizes[self.me]
                                                      for u in held[k]])):
                _put(self.jobs, self.units[u], block)


def _put(jobs: Sequence[Job], unit: _Unit, block: Tensor) -> None:
    """A matrix's result block (flat) into its job's ``result``."""
    job = jobs[unit.job]
    if unit.at == ():
        job.result = block.view(job.local.shape)
    else:
        job.result[unit.at] = block.view(job.result.shape[len(unit.at):])


def _share_results(jobs: Sequence[Job], units: Sequence[_Unit], replica: Sequence[int],
                   replicas: Any, copy: int, dtype: torch.dtype) -> None:
    """The results of the matrices that the other replicas iterated (``replica[u]``: the one
    that iterated matrix ``u``; this rank's is ``copy``), from the ranks of ``replicas`` that
    hold the same blocks: one ``all_gather`` of each rank's blocks of its replica's results,
    padded to the largest such piece (every rank of ``replicas`` knows all their sizes from
    the layout)."""
    copies = dist.get_world_size(replicas)
    held = [[u for u in range(len(units)) if replica[u] == c and units[u].at is not None]
            for c in range(copies)]
    sizes = [sum(_size(jobs, units[u]) for u in held[c]) for c in range(copies)]
    size = max(sizes)
    if size == 0:
        return
    device = jobs[0].local.device
    piece = torch.zeros(size, dtype=dtype, device=device)
    if held[copy]:
        torch.cat([_result_of(jobs, units[u]).reshape(-1) for u in held[copy]],
                  out=piece[:sizes[copy]])
    gathered = [torch.empty(size, dtype=dtype, device=device) for _ in range(copies)]
    dist.all_gather(gathered, piece, group=replicas)
    for c in range(copies):
        if c == copy:
            continue
        for u, block in zip(held[c], gathered[c][:sizes[c]].split(
                [_size(jobs, units[u]) for u in held[c]])):
            _put(jobs, units[u], block)


def _size(jobs: Sequence[Job], unit: _Unit) -> int:
    """The elements of this rank's block of ``unit``."""
    local = jobs[unit.job].local
    return local.numel() if unit.at == () else math.prod(local.shape[len(unit.at):])


def _result_of(jobs: Sequence[Job], unit: _Unit) -> Tensor:
    result = jobs[unit.job].result
    return result if unit.at == () else result[unit.at]


def _flat(pieces: Sequence[Sequence[Tensor]], device: torch.device, dtype: torch.dtype) -> Tensor:
    flat = [t for per_rank in pieces for t in per_rank]
    return torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)


def adjusted_lr(lr: float, adjust_lr_fn: Any, shape: Sequence[int]) -> float:
    """The learning rate of a matrix of ``shape`` (global): torch.optim.Muon's ``original``
    (``lr sqrt(max(1, A/B))``, also for None) or ``match_rms_adamw`` (``0.2 lr sqrt(max(A, B))``)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))
