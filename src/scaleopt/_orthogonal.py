"""Muon's orthogonalization: the Newton-Schulz iteration, on whole matrices also when FSDP2
(or HSDP, or tensor parallelism) shards them.

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

Tensor parallelism's placements are joined the same way: a ``Shard(1)`` matrix by its column
blocks (the owner concatenates them into the contiguous matrix one process holds); a matrix
cut along two mesh dimensions (FSDP x TP) is refused by name. With ``buckets`` > 1 the
matrices go in runs of about equal cost whose all-to-alls are asynchronous, one run's blocks
travelling while the run before is iterated (:class:`_Runs`). The iteration's coefficients
are one triple, one per step, or a named iteration (:data:`NS_METHODS`, :func:`polar_express`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._sharding import _dtensor, _sharding_groups

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


def owners(shapes: Sequence[Sequence[int]], ranks: int) -> List[int]:
    """The rank that iterates each matrix: the costliest first, each to the rank with the least
    work so far (the lowest such rank); the same answer on every rank."""
    load = [0] * ranks
    owner = [0] * len(shapes)
    for j in sorted(range(len(shapes)), key=lambda j: (-cost(shapes[j]), j)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        owner[j] = r
        load[r] += cost(shapes[j])
    return owner


def shard_rows(rows: int, ranks: int) -> List[int]:
    """The rows of each rank under ``Shard(0)`` (torch.chunk's cut: ceil(rows / ranks) each, the
    last ones fewer or none)."""
    full = -(-rows // ranks) if ranks else 0
    return [max(0, min(rows, (k + 1) * full) - k * full) for k in range(ranks)]


class Job:
    """One matrix to orthogonalize: its parameter (for its layout), the local rows of the
    matrix to iterate, and, once done, the local rows of the result."""

    __slots__ = ("param", "local", "result")

    def __init__(self, param: Tensor, local: Tensor) -> None:
        self.param, self.local, self.result = param, local, None


def orthogonalize(jobs: Sequence[Job], coefficients: Any, steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16, buckets: int = 1) -> None:
    """Each job's ``result``: the local rows of the iteration (in ``dtype``) of its whole
    matrix (see the module doc); one exchange each way per process group that shards any of
    them, or with ``buckets`` > 1 that many, overlapped with the iteration."""
    iteration = functools.partial(newton_schulz, coefficients=coefficients, steps=steps,
                                  eps=eps, dtype=dtype)
    by_group: Dict[Any, List[Tuple[Job, int]]] = {}
    for job in jobs:
        split = _split(job.param)
        if split is None:
            job.result = iteration(job.local)
        else:
            by_group.setdefault(split[:2], []).append((job, split[2]))
    for (group, replicas), members in by_group.items():
        _exchange(group, replicas, [job for job, _ in members], [dim for _, dim in members],
                  iteration, dtype, buckets)


def whole_here(p: Tensor) -> bool:
    """Whether ``p`` is iterated where it is, with no exchange: nothing splits it over more
    than one rank. Such a matrix's update is made, applied and freed before the next one's is
    made, so that a step holds one update at a time."""
    return _split(p) is None


def _split(p: Tensor) -> Any:
    """How ``p`` is split: (the process group that cuts it into blocks along one dimension,
    the one over which those blocks are replicated or None, that dimension): FSDP2's
    ``Shard(0)``, tensor parallelism's ``Shard(0)`` (column-wise) and ``Shard(1)`` (row-wise),
    each also under HSDP's ``Replicate()``. None where nothing splits ``p``; an error naming
    the placement for a matrix cut along two mesh dimensions (FSDP x TP), which the exchange
    does not assemble."""
    if not isinstance(p, _dtensor()):
        return None
    groups = _sharding_groups(p)
    if not groups:
        return None
    shards = [pl for pl in p.placements if pl.is_shard()]
    copies = [d for d, pl in enumerate(p.placements) if pl.is_replicate()]
    if len(groups) != 1 or type(shards[0]).__name__ != "Shard" or len(copies) > 1:
        raise NotImplementedError(
            f"Muon assembles a sharded matrix from blocks cut along one mesh dimension (FSDP2's "
            f"Shard(0), tensor parallelism's Shard(0) or Shard(1), each also as HSDP's "
            f"(Replicate(), Shard(d))); a {tuple(p.shape)} parameter is placed {p.placements}, "
            f"cut along {len(groups)} mesh dimensions: the exchange would need a gather over "
            f"both (FSDP x TP), which it does not do")
    if dist.get_world_size(groups[0]) == 1:
        return None
    replicas = p.device_mesh.get_group(copies[0]) if copies else None
    return (groups[0], replicas if replicas is not None and dist.get_world_size(replicas) > 1
            else None, shards[0].dim)


def _exchange(group: Any, replicas: Any, jobs: Sequence[Job], dims: Sequence[int],
              iteration: Callable[[Tensor], Tensor], dtype: torch.dtype,
              buckets: int = 1) -> None:
    """The jobs' results (see the module doc): ``group`` cuts job ``j``'s matrix along
    ``dims[j]``, ``replicas`` (or None) holds the same blocks again."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    copies, copy = ((dist.get_world_size(replicas), dist.get_rank(replicas))
                    if replicas is not None else (1, 0))
    shapes = [tuple(job.param.shape) for job in jobs]
    cuts = [shard_rows(shape[d], ranks) for shape, d in zip(shapes, dims)]
    for job, d, cut in zip(jobs, dims, cuts):
        if job.local.shape[d] != cut[me]:
            raise NotImplementedError(
                f"Muon expects torch.chunk's blocks of a {tuple(job.param.shape)} parameter "
                f"along dimension {d} over {ranks} ranks ({cut[me]} here), and the local shard "
                f"has {job.local.shape[d]}")
    # the runs of the exchange (one unless buckets > 1), by the iteration's cost, and in each
    # run the owners (slot // ranks: the replica, slot % ranks: its rank), so that every rank
    # has about its share of each run's work
    runs = buckets_of([cost(shape) for shape in shapes], buckets)
    slot = [0] * len(jobs)
    for run in runs:
        for j, o in zip(run, owners([shapes[j] for j in run], copies * ranks)):
            slot[j] = o
    ours = [[j for j in run if slot[j] // ranks == copy] for run in runs]
    _iterate_ours(jobs, shapes, dims, cuts, [o % ranks for o in slot], ours, group, iteration,
                  dtype, jobs[0].local.device)
    if copies > 1:
        _share_results(jobs, [slot[j] // ranks for j in range(len(jobs))], replicas, copy,
                       dtype)


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


def _iterate_ours(jobs: Sequence[Job], shapes: Sequence[Tuple[int, int]], dims: Sequence[int],
                  cuts: Sequence[List[int]], owner: Sequence[int], runs: List[List[int]],
                  group: Any, iteration: Callable[[Tensor], Tensor], dtype: torch.dtype,
                  device: torch.device) -> None:
    """The ``result`` (its local block) of each job of ``runs``: the matrix iterated by the rank
    ``owner[j]`` of ``group``, to which the blocks travel in an all-to-all and from which they
    come back in another. Job ``j``'s matrix is cut along ``dims[j]`` as ``cuts[j]`` says; the
    owner joins the blocks into the matrix one process holds (contiguous) and cuts the result
    the same way.

    Each run's exchanges are asynchronous: the next run's blocks travel while this one's
    matrices are iterated, and each run's results go back while the next ones are iterated, so
    that with several runs the exchange hides behind the iteration (the same matrices, the same
    bits). One run: two all-to-alls (both empty where it has no jobs: every rank of ``group``
    takes part)."""
    exchange = _Runs(jobs, shapes, dims, cuts, owner, group, dtype, device)
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


class _Runs:
    """The exchange of :func:`_iterate_ours`, run by run: what every run shares (the jobs, how
    they are cut and owned, the process group)."""

    def __init__(self, jobs: Sequence[Job], shapes: Sequence[Tuple[int, int]],
                 dims: Sequence[int], cuts: Sequence[List[int]], owner: Sequence[int],
                 group: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.jobs, self.shapes, self.dims, self.cuts, self.owner = jobs, shapes, dims, cuts, owner
        self.group, self.dtype, self.device = group, dtype, device
        self.ranks, self.me = dist.get_world_size(group), dist.get_rank(group)

    def block(self, j: int, k: int) -> Tuple[int, int]:
        """The shape of rank ``k``'s block of job ``j``'s matrix."""
        shape = list(self.shapes[j])
        shape[self.dims[j]] = self.cuts[j][k]
        return shape[0], shape[1]

    def _all_to_all(self, send: Tensor, receive_sizes: List[int],
                    send_sizes: List[int]) -> Tuple[Tensor, Any]:
        received = torch.empty(sum(receive_sizes), dtype=self.dtype, device=self.device)
        return received, dist.all_to_all_single(
            received, send, output_split_sizes=receive_sizes, input_split_sizes=send_sizes,
            group=self.group, async_op=True)

    def send(self, run: List[int]) -> Tuple[Any, ...]:
        """The run's blocks on their way to their owners (asynchronously)."""
        mine = [j for j in run if self.owner[j] == self.me]
        send = [[self.jobs[j].local.to(self.dtype).reshape(-1) for j in run
                 if self.owner[j] == k] for k in range(self.ranks)]
        sent = [sum(t.numel() for t in pieces) for pieces in send]
        taken = [sum(math.prod(self.block(j, k)) for j in mine) for k in range(self.ranks)]
        flat = _flat(send, self.device, self.dtype)
        return (run, mine, sent, taken, flat) + self._all_to_all(flat, taken, sent)

    def iterate(self, posted: Tuple[Any, ...], iteration: Callable[[Tensor], Tensor]
                ) -> Tuple[Any, ...]:
        """Once a run's blocks are here: this rank's matrices joined and iterated, and the
        results' blocks on their way back (asynchronously)."""
        run, mine, sent, taken, _, got, work = posted
        work.wait()
        from_rank = [piece.split([math.prod(self.block(j, k)) for j in mine])
                     for k, piece in enumerate(got.split(taken))]
        back: List[List[Tensor]] = [[] for _ in range(self.ranks)]
        for i, j in enumerate(mine):
            whole = torch.cat([from_rank[k][i].view(self.block(j, k))
                               for k in range(self.ranks)], dim=self.dims[j])
            for k, piece in enumerate(iteration(whole).split(self.cuts[j], dim=self.dims[j])):
                back[k].append(piece.reshape(-1))
        flat = _flat(back, self.device, self.dtype)
        return (run, sent, flat) + self._all_to_all(flat, sent, taken)

    def receive(self, returning: Tuple[Any, ...]) -> None:
        """Once a run's results are back: each job's ``result``, a view of its block."""
        run, sent, _, returned, work = returning
        work.wait()
        jobs, owner = self.jobs, self.owner
        pieces = [piece.split([jobs[j].local.numel() for j in run if owner[j] == k])
                  for k, piece in enumerate(returned.split(sent))]
        position = [0] * self.ranks
        for j in run:
            jobs[j].result = pieces[owner[j]][position[owner[j]]].view(jobs[j].local.shape)
            position[owner[j]] += 1


def _share_results(jobs: Sequence[Job], replica: Sequence[int], replicas: Any, copy: int,
                   dtype: torch.dtype) -> None:
    """The results of the jobs that the other replicas iterated (``replica[j]``: the one that
    iterated job ``j``; this rank's is ``copy``), from the ranks of ``replicas`` that hold the
    same rows: one ``all_gather`` of each rank's rows of its replica's results, padded to the
    largest such piece (every rank of ``replicas`` knows all their sizes from the shapes)."""
    copies = dist.get_world_size(replicas)
    sizes = [sum(jobs[j].local.numel() for j in range(len(jobs)) if replica[j] == c)
             for c in range(copies)]
    size = max(sizes)
    if size == 0:
        return
    device = jobs[0].local.device
    mine = [jobs[j].result.reshape(-1) for j in range(len(jobs)) if replica[j] == copy]
    piece = torch.zeros(size, dtype=dtype, device=device)
    if mine:
        torch.cat(mine, out=piece[:sizes[copy]])
    gathered = [torch.empty(size, dtype=dtype, device=device) for _ in range(copies)]
    dist.all_gather(gathered, piece, group=replicas)
    for c in range(copies):
        if c == copy:
            continue
        theirs = [j for j in range(len(jobs)) if replica[j] == c]
        for j, block in zip(theirs, gathered[c][:sizes[c]].split(
                [jobs[j].local.numel() for j in theirs])):
            jobs[j].result = block.view(jobs[j].local.shape)


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
