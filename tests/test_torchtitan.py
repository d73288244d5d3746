"""torchtitan as a client: its llama3 debug model trained under FSDP2 on 2 gloo processes by
scaleopt's LAMB, LANS and Muon, named in its config through
:mod:`scaleopt.integrations.torchtitan`; a run resumed from its step-2 checkpoint ends with the
same losses and the same step-4 checkpoint, bit for bit, as the uninterrupted run.

torchtitan 0.3.0 (the ``torchtitan`` extra) on torch 2.13.0 (constraints.txt); what it
hard-codes for CUDA is patched in the job (tests/helpers/torchtitan_job.py says what and why).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

HELPERS = pathlib.Path(__file__).resolve().parent / "helpers"
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


@pytest.fixture
def titan():
    return pytest.importorskip("torchtitan", reason="needs the torchtitan extra")


def test_the_integration_imports_without_torchtitan_and_says_what_it_needs(monkeypatch):
    from scaleopt.integrations import torchtitan

    torchtitan._container.cache_clear()
    for name in ("torchtitan", "torchtitan.components.optimizer"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    try:
        with pytest.raises(ImportError, match=r"pip install 'scaleopt\[torchtitan\]'"):
            torchtitan.ScaleOptimizersContainer
    finally:
        torchtitan._container.cache_clear()
    assert set(torchtitan.OPTIMIZERS) >= {"LAMB", "LANS", "Muon", "OffloadAdam"}


def test_the_integration_imports_and_names_scaleopts_optimizers(titan):
    import scaleopt
    from scaleopt.integrations import torchtitan
    from torchtitan.components.optimizer import OptimizersContainer

    container = torchtitan.ScaleOptimizersContainer
    assert issubclass(container, OptimizersContainer)
    assert container._resolve_optimizer_factory("LAMB") is scaleopt.LAMB
    assert container._resolve_optimizer_factory("AdamW") is torch.optim.AdamW  # torchtitan's
    with pytest.raises(NotImplementedError, match="LAMB"):
        container._resolve_optimizer_factory("Lamb")
    config = torchtitan.optimizer_config("scaleopt.AdamW", lr=1e-3, state_dtype="int8")
    assert config.param_groups[0].optimizer_kwargs == {"lr": 1e-3, "state_dtype": "int8"}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opts = config.build(model_parts=[model])
    (opt,) = opts.optimizers
    assert isinstance(opt, scaleopt.AdamW) and opt.param_groups[0]["state_dtype"] == "int8"
    # torchtitan's default implementation ("fused") reaches every group as torch.optim's flag
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    exact = torchtitan.optimizer_config("LAMB", lr=1e-3, implementation="single")
    (lamb,) = exact.build(model_parts=[model]).optimizers
    assert lamb.param_groups[0]["implementation"] == "single"
    (offloaded,) = torchtitan.optimizer_config("OffloadLAMB", lr=1e-3).build(
        model_parts=[model]).optimizers
    assert isinstance(offloaded, scaleopt.LAMB) and offloaded.host is not None
    momentum = torchtitan.optimizer_config("Momentum", lr=0.1)
    with pytest.raises(ValueError, match="fused=True: Momentum has no fused kernels"):
        momentum.build(model_parts=[model])
    momentum = torchtitan.optimizer_config("Momentum", lr=0.1, titan_implementation="foreach")
    (sgd,) = momentum.build(model_parts=[model]).optimizers
    assert sgd.param_groups[0]["foreach"] is True


def make_assets(folder: pathlib.Path) -> None:
    """The job's text (Python's documentation topics, one JSON line each, as torchtitan's C4
    test set) and a byte-level BPE tokenizer of 2000 tokens trained on it (the debug model's
    vocabulary is 2048)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [topics[k] for k in sorted(topics)]
    (folder / "data").mkdir(parents=True)
    with open(folder / "data" / "train.json", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False))
    (folder / "tokenizer").mkdir()
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": True,
         "add_eos_token": True}))


def run_job(folder: pathlib.Path, optimizer: str, steps: int, model: str = "llama3",
            ep: int = 1) -> dict:
    """torchrun, 2 processes, the job in ``folder`` (torchtitan's debug ``model``, with expert
    parallelism of degree ``ep``): rank 0's loss at each step it ran."""
    from scaleopt.cli.launch import free_port

    env = dict(os.environ, JOB_DIR=str(folder), OPTIMIZER=optimizer, STEPS=str(steps),
               MODEL=model, EP=str(ep),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                   [str(HELPERS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(HELPERS / "torchtitan_job.py")]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # torchrun and its workers
        out, _ = job.communicate()
        pytest.fail(f"the torchtitan job ran over 300 s:\n{out[-3000:]}")
    assert job.returncode == 0, out[-4000:]
    losses = {}
    for line in out.splitlines():
        found = STEP.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if found:
            losses.setdefault(int(found[1]), float(found[2]))
    return losses


def checkpoint(folder: pathlib.Path) -> dict:
    """A torchtitan (DCP) checkpoint folder as one flat dict of its entries."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.with_suffix(".pt"))

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out
    return flat(torch.load(folder.with_suffix(".pt"), weights_only=False))


def equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,model,ep", [
    ("LAMB", "llama3", 1), ("LANS", "llama3", 1), ("Muon", "llama3", 1),
    ("Muon", "deepseek_v3", 1), ("Muon", "deepseek_v3", 2)])
def test_torchtitan_trains_with_it_and_resumes_bit_for_bit(titan, tmp_path, optimizer, model,
                                                          ep):
    """(deepseek_v3: its mixture-of-experts debug model, whose experts' [8, 256, 256] weights
    Muon takes as stacks of matrices, each expert's whole on one of the 2 ranks: cut by FSDP2,
    or with ``ep`` 2 by torchtitan's expert parallelism.)"""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    make_assets(full)
    losses = run_job(full, optimizer, steps=4, model=model, ep=ep)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses

    shutil.copytree(full / "data", resumed / "data")
    shutil.copytree(full / "tokenizer", resumed / "tokenizer")
    shutil.copytree(full / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    again = run_job(resumed, optimizer, steps=4, model=model, ep=ep)
    assert again == {3: losses[3], 4: losses[4]}

    mine, theirs = (checkpoint(f / "checkpoints" / "step-4") for f in (full, resumed))
    assert mine.keys() == theirs.keys()
    # the model, the optimizer's state and groups, the step: all of it bit for bit. (Not the
    # data loader's read-ahead: a resumed loader may hold one more document of the same
    # stream in its buffer, which changes no batch.)
    differ = [k for k in mine if not k.startswith("dataloader.") and not equal(mine[k], theirs[k])]
    assert not differ, differ[:5]
    assert sum(k.startswith("optimizer.state.") for k in mine) > 30
    # the groups are scaleopt's: its options, and torchtitan's flags, saved with them
    groups = {k.rsplit(".", 1)[-1] for k in mine if k.startswith("optimizer.param_groups.")}
    assert {"fused", "foreach", "max_grad_norm", "state_dtype"} <= groups
    assert ("lower_bound" in groups) == (optimizer in ("LAMB", "LANS"))
    assert ("ns_steps" in groups) == (optimizer == "Muon")
    if model == "deepseek_v3":  # every expert stack has Muon's momentum, one per expert
        stacks = {k: v for k, v in mine.items() if k.startswith("optimizer.state.")
                  and "routed_experts" in k and k.endswith(".momentum_buffer")}
        assert len(stacks) == 3 * 5 and all(v.shape == (8, 256, 256) for v in stacks.values())
