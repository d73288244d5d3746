"""The Triton kernels' launch table (``scaleopt._triton_launch``): read from the package's file
or another, checked, and what the launches take; and the sweep that chooses one
(``tools/triton_sweep.py``) with timings given to it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scaleopt import _triton_launch as L


def test_the_package_table_names_every_kernel_and_form_and_is_valid():
    table = L.load(str(L.DEFAULT))
    assert set(table.chunks) == set(L.FORMS)
    assert set(table.launches) == {(k, f) for k in L.KERNELS for f in L.FORMS}
    # a chunk of 4096 elements, tiles of 1024, 4 warps: 32 elements a thread
    assert table.constants("lamb_apply", "float32") == dict(BLOCK=1024, QB=4, ITERS=4,
                                                            num_warps=4, num_stages=3)
    # int8 moments: a chunk of 2048 (8 blocks), one warp a program, one block a tile (the
    # first phases and sum_squares: two), 64 elements a thread
    assert table.blocks("int8") == 8
    assert table.constants("lamb_apply", "int8") == dict(BLOCK=256, QB=1, ITERS=8,
                                                         num_warps=1, num_stages=3)
    assert table.constants("lans_sums", "int8") == dict(BLOCK=512, QB=2, ITERS=4,
                                                        num_warps=1, num_stages=3)
    assert L.from_dict(json.loads(json.dumps(table.as_dict()))) == table


def test_another_file_is_read_where_the_environment_names_one(tmp_path, monkeypatch):
    table = L.uniform(chunk=8192, block=2048, warps=8, stages=2)
    path = tmp_path / "launch.json"
    L.save(table, str(path))
    monkeypatch.setenv(L.ENVIRON, str(path))
    assert L.load() == table
    assert L.load().constants("lans_sums", "int8") == dict(BLOCK=2048, QB=8, ITERS=4,
                                                          num_warps=8, num_stages=2)
    # and a process that imports the package launches by it
    out = subprocess.run([sys.executable, "-c", "from scaleopt import _triton; "
                          "print(_triton.LAUNCH.launch('lamb_sums', 'bfloat16').warps)"],
                         capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, L.ENVIRON: str(path)})
    assert out.stdout.strip() == "8"


@pytest.mark.parametrize("change, message", [
    (lambda d: d["launches"]["lamb_sums"]["float32"].update(block=1000), "power of two"),
    (lambda d: d["chunks"].update(float32=3584), "not a multiple of 16 and of the block 1024"),
    (lambda d: d["chunks"].update(bfloat16=8), "not a multiple of 16"),
    (lambda d: d["launches"]["lans_apply"]["int8"].update(warps=3), "warps 3"),
    (lambda d: d["launches"]["lans_apply"]["int8"].update(stages=0), "stages 0"),
    (lambda d: d["launches"]["lamb_apply"]["int8"].update(block=128), "share their chunk"),
    (lambda d: d["launches"].pop("totals", None) or d["launches"].pop("sum_squares"),
     "needs 'chunks'"),
])
def test_a_bad_table_is_a_clear_error(change, message):
    data = L.load(str(L.DEFAULT)).as_dict()
    change(data)
    with pytest.raises(ValueError, match=message):
        L.from_dict(data)


def test_each_launch_takes_its_kernels_and_forms_sizes_warps_and_stages(monkeypatch):
    """The launcher passes each kernel the table's entry for its kernel and form."""
    import torch
    from torch import nn

    import scaleopt
    from scaleopt import _triton

    pytest.importorskip("triton")
    table = L.uniform(chunk=4096, block=1024)
    table.launches[("lamb_sums", "int8")] = L.Launch(2048, 8, 2)
    table.launches[("lamb_apply", "int8")] = L.Launch(512, 2, 1)
    monkeypatch.setattr(_triton, "LAUNCH", L.check(table))
    seen = {}
    monkeypatch.setattr(_triton, "_run", lambda name, programs, *a, **k: seen.setdefault(
        (name, k.get("FORM")), (programs, {n: k.get(n) for n in
                                            ("BLOCK", "QB", "ITERS", "num_warps", "num_stages")})))
    p = nn.Parameter(torch.randn(64, 1024))
    opt = scaleopt.LAMB([p], lr=1e-3, implementation="triton", state_dtype="int8")
    p.grad = torch.randn_like(p)
    opt.step()
    form = 2  # int8
    # 64 rows of 4 blocks: 256 blocks, 16 to a chunk
    assert seen[("lamb_sums", form)] == (16, dict(BLOCK=2048, QB=8, ITERS=2, num_warps=8,
                                                  num_stages=2))
    assert seen[("lamb_apply", form)] == (16, dict(BLOCK=512, QB=2, ITERS=8, num_warps=2,
                                                   num_stages=1))


def _sweep():
    import importlib
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[1] / "tools")
    sys.path.insert(0, tools)
    try:
        return importlib.import_module("triton_sweep")
    finally:
        sys.path.remove(tools)


def test_the_sweep_tries_every_valid_candidate_the_packages_first():
    S = _sweep()
    cands = S.candidates()
    # the package's table: LAMB's float32 apply's launch, then the int8 kernels' (one warp,
    # the first phases' tiles of 512 before the applies' of 256: cheaper to compile), the
    # only others it has
    own = [(4096, 1024, 4), (2048, 512, 1), (2048, 256, 1)]
    assert cands[:3] == own
    assert len(cands) == len(set(cands))
    assert all(b <= c and c % b == 0 for c, b, _ in cands)
    grid = {(c, b, w) for c in S.CHUNKS for b in S.BLOCKS for w in S.WARPS if b <= c}
    assert set(cands) == grid | set(own)
    for cand in cands:  # each a valid table
        assert S.table_of(cand).constants("lamb_apply", "int8")["num_warps"] == cand[2]
    # then the cheapest to compile first (a thread's unrolled code grows with chunk / warps),
    # so that a sweep out of time has timed the most it could: 2048 elements with 8 warps
    # first, 16384 with 2 last
    per_thread = [c / w for c, _, w in cands[3:]]
    assert per_thread == sorted(per_thread)
    assert cands[3][::2] == (2048, 8) and cands[-1][::2] == (16384, 2)


def test_the_sweep_chooses_per_form_the_chunk_and_per_kernel_the_fastest_tile_and_warps():
    """With given times: per form, the chunk at which the form's kernels' best times (each
    relative to the package table's on the same set) add up to the least; per kernel the
    fastest candidate at that chunk; the sets weigh alike however long their steps."""
    S = _sweep()
    default = L.load(str(L.DEFAULT))
    times = {}
    for s, scale in (("base", 1.0), ("1b", 10.0)):
        for kernel in ("lamb_sums", "lamb_apply"):
            for form in L.FORMS:
                for cand in S.candidates():
                    times[(s, kernel, form, cand)] = scale * 1.0
    # float32: at chunk 8192, lamb_sums is fastest with tiles of 2048 and 8 warps, lamb_apply
    # with 512 and 2 warps; at chunk 16384 lamb_sums alone is faster still, but lamb_apply
    # much slower: the chunk of the least total is 8192
    for s, scale in (("base", 1.0), ("1b", 10.0)):
        times[(s, "lamb_sums", "float32", (8192, 2048, 8))] = 0.7 * scale
        times[(s, "lamb_apply", "float32", (8192, 512, 2))] = 0.8 * scale
        times[(s, "lamb_sums", "float32", (16384, 4096, 8))] = 0.5 * scale
        for cand in S.candidates():
            if cand[0] == 16384:
                times[(s, "lamb_apply", "float32", cand)] = 1.5 * scale
    # bfloat16: one set alone finds a faster candidate; the other finds it much slower
    times[("base", "lamb_apply", "bfloat16", (2048, 512, 4))] = 0.5
    times[("1b", "lamb_apply", "bfloat16", (2048, 512, 4))] = 20.0
    chosen = S.choose(times, default)
    assert chosen.chunk("float32") == 8192
    assert chosen.launch("lamb_sums", "float32") == L.Launch(2048, 8, S.STAGES)
    assert chosen.launch("lamb_apply", "float32") == L.Launch(512, 2, S.STAGES)
    # a kernel with no time (LANS's here) keeps its tile and warps at the new chunk
    assert chosen.launch("lans_apply", "float32") == default.launch("lans_apply", "float32")
    # all equal: the package's own, ties broken towards it
    assert chosen.chunk("int8") == default.chunk("int8") == 2048
    assert chosen.launch("lamb_sums", "int8") == default.launch("lamb_sums", "int8")
    assert chosen.chunk("bfloat16") == 4096
    assert chosen.launch("lamb_apply", "bfloat16") == default.launch("lamb_apply", "bfloat16")
    # what the package reads back
    path = __import__("tempfile").mktemp(suffix=".json")
    L.save(chosen, path)
    assert L.load(path) == chosen


def test_the_sweep_reports_each_kernels_bandwidth_as_a_share_of_the_copy():
    S = _sweep()
    default = L.load(str(L.DEFAULT))
    cand = (4096, 1024, 4)
    times = {("base", "lamb_apply", "float32", cand): 2e-3}
    sizes = {"base": {("lamb_apply", "float32"): 4e9}}  # 4 GB in 2 ms: 2000 GB/s
    got = S.bandwidths(times, default, sizes, {"base": 2.5e12})
    assert got["base"]["lamb_apply float32"] == pytest.approx(dict(ms=2.0, gb_s=2000.0,
                                                                   of_copy=0.8))
    report = dict(device="GPU", candidates=45, seconds=100.0, skipped=0,
                  copy_gb_s={"base": 2500.0}, before=got, after=got)
    assert "| base | lamb_apply float32 | 2.000 | 80% | 2.000 | 80% |" in S.summary(report)


def test_the_sweep_says_so_and_exits_3_without_a_cuda_device(tmp_path):
    import os
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "triton_sweep.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(tool), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 3 and "no CUDA device" in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_sweep_counts_each_kernels_elements_by_its_tensors_moments():
    """The bytes the sweep divides by: each (kernel, form) of a step gets the elements of the
    tensors whose moments are in that form (compact ones for the matrices, float32 for the
    small tensors)."""
    import torch
    from torch import nn

    import scaleopt

    pytest.importorskip("triton")
    S = _sweep()
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 8))
    for name, kernels in (("AdamW", ["adam_apply"]), ("LANS", ["lans_sums", "lans_apply",
                                                               "sum_squares"])):
        opt = getattr(scaleopt, name)(model.parameters(), lr=1e-3, implementation="triton",
                                      state_dtype="int8")
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        got = S._numels(opt)
        assert got == {**{(k, "int8"): 128 * 64 for k in kernels},
                       **{(k, "float32"): 64 + 64 * 8 + 8 for k in kernels}}, name


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_sweep_times_each_kernel_and_form_of_real_steps_under_every_candidate():
    """``measure`` as the GPU sweep runs it, here on CPU tensors under the interpreter (the
    host clock instead of CUDA events): a LAMB, a LANS and an AdamW step per state form and
    candidate, each launch's time given to its kernel and its tensors' form, the bytes each
    moves, and a table chosen from them."""
    import math

    pytest.importorskip("triton")
    S = _sweep()
    cands = [(2048, 512, 4), (4096, 1024, 2)]
    # a matrix whose moments go int8 in that form, and a vector that keeps float32 moments
    sets = {"tiny": [("w", (16, 256)), ("b", (256,))]}
    times, sizes, copy, skipped = S.measure(sets, cands, rounds=1, deadline=math.inf,
                                            device="cpu")
    assert skipped == [] and copy["tiny"] > 0
    kernels = {"lamb_sums", "lamb_apply", "lans_sums", "lans_apply", "sum_squares",
               "adam_apply"}
    expected = {(k, f) for k in kernels for f in ("float32", "bfloat16", "int8")}
    for cand in cands:
        got = {(k, f): t for (s, k, f, c), t in times.items() if c == cand}
        assert set(got) == expected, cand
        assert all(t > 0 for t in got.values())
    # the bytes: each form's kernels by the tensors whose moments are in that form (the
    # vector's float32 moments of a compact step are not the float32 form's times)
    import sass_budget

    def moved(kernel, form):
        return sum(sass_budget.moved(kernel, dict(W_SPLIT=0, G_KIND=0, W16_KIND=0,
                                                  FORM=S._format_forms()[form])))

    assert sizes["tiny"][("adam_apply", "int8")] == 4096 * moved("adam_apply", "int8")
    assert sizes["tiny"][("lamb_sums", "float32")] == (4096 + 256) * moved("lamb_sums", "float32")
    table = S.choose(times, S.L.load(str(S.L.DEFAULT)))
    assert {table.chunk(f) for f in S.L.FORMS} <= {2048, 4096}


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_sweep_compiles_in_processes_and_leaves_out_a_candidate_that_fails(monkeypatch,
                                                                               capsys):
    """``warm`` as the GPU sweep runs it, here in processes stepping CPU tensors under the
    interpreter: the candidates done come back in their order, and one that cannot be
    launched (a tile larger than its chunk) is left out and said, the others kept."""
    from pathlib import Path

    pytest.importorskip("triton")
    S = _sweep()
    # the processes import the sweep by name, as the sweep's own do from tools/
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    bad = (2048, 4096, 4)
    got = S.warm([(4096, 1024, 4), bad, (2048, 512, 2)], 2, device="cpu")
    assert got == [(4096, 1024, 4), (2048, 512, 2)]
    assert f"candidate {bad} did not compile" in capsys.readouterr().out
