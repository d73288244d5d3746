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
    # a chunk of 4096 elements (16 int8 blocks), tiles of 1024, 4 warps: 32 elements a thread
    assert table.constants("lamb_apply", "float32") == dict(BLOCK=1024, QB=4, ITERS=4,
                                                            num_warps=4, num_stages=3)
    assert table.blocks("int8") == 16
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
