"""torchtitan's trainer (0.3.0) on CPUs with gloo, training its llama3 debug model with a
scaleopt optimizer named in the config (:mod:`scaleopt.integrations.torchtitan`): the job that
tests/test_torchtitan.py starts with torchrun, ``python -m torch.distributed.run
--nproc-per-node 2 torchtitan_job.py`` with ``JOB_DIR`` (its folder, where the test
wrote the tokenizer and the text), ``OPTIMIZER`` and ``STEPS`` in the environment.

torchtitan 0.3.0 is written for CUDA GPUs. What it hard-codes for them is patched here, before
torchtitan reads it, and nothing else; none of it touches the optimizer:

1. the device: torch finds no accelerator, and torchtitan then assumes ``"cuda"``; here it is
   told ``"cpu"``;
2. ``torch.cpu`` lacks what torchtitan's GPU memory monitor calls (``get_device_name``,
   ``get_device_properties``, ``memory_stats``, ...): the host's memory is the capacity and
   the stats are empty (its log then shows 0 GiB), and ``current_device()`` is 0 (torchtitan
   hands it to ``barrier(device_ids=...)``, which takes an int);
3. ``torch.distributed.set_timeout``, which torch 2.13 lacks: torchtitan only lowers the
   collectives' timeout with it after the first step; that is skipped;
4. FlexAttention has no backward on CPUs: the same attention, each BlockMask's ``mask_mod``
   made into a dense mask, through ``scaled_dot_product_attention``;
5. torchtitan sets FSDP's gradient divide factor to 1.0, which FSDP reduces with
   ``PREMUL_SUM``, an op gloo does not have: FSDP is told to reduce with ``SUM`` (and
   divide by the factor, 1.0), the same numbers.

And two options of torchtitan's config: ``parallelism.spmd_backend="partial_dtensor"`` (its
default, ``spmd_types``, wants DTensor parameters on the full mesh) and
``training.disable_cuda_graphs``.
"""

from __future__ import annotations

import os
import pathlib
import sys
import types

import torch
import torch._utils
import torch.nn.functional as F

torch._utils._get_available_device_type = lambda: "cpu"  # 1 (read when torchtitan imports)
torch.cpu.get_device_name = lambda device=None: "cpu"  # 2
torch.cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
    name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
torch.cpu.memory_stats = lambda device=None: {}
torch.cpu.reset_peak_memory_stats = lambda device=None: None
torch.cpu.empty_cache = lambda: None
torch.cpu.current_device = lambda: 0

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402

import torchtitan.distributed.fsdp as titan_fsdp  # noqa: E402
import torchtitan.distributed.utils as titan_dist  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.models import deepseek_v3, llama3  # noqa: E402
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3_configs  # noqa: E402
from torchtitan.models.llama3 import config_registry as llama3_configs  # noqa: E402

from scaleopt.integrations.torchtitan import optimizer_config  # noqa: E402

if not hasattr(torch.distributed, "set_timeout"):  # 3
    titan_dist.set_pg_timeouts = lambda timeout, parallel_dims: None


def _flex_attention_on_cpu(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                           kernel_options):  # 4
    assert score_mod is None and not return_aux.lse
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=enable_gqa), None


FlexAttention.compiled_flex_attn = staticmethod(_flex_attention_on_cpu)
_divide_by_one = titan_fsdp.disable_fsdp_gradient_division


def _sum_on_gloo(model):  # 5
    _divide_by_one(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


titan_fsdp.disable_fsdp_gradient_division = _sum_on_gloo

#: each optimizer's options in the job
OPTIONS = {"LAMB": dict(lr=2e-3, weight_decay=0.01), "LANS": dict(lr=2e-3, weight_decay=0.01),
           "Muon": dict(lr=2e-2, adamw_lr=2e-3, weight_decay=0.01)}


def scaleopt_debugmodel():
    """torchtitan's debug model ``MODEL`` (``llama3``, the default: 6 layers of width 256;
    ``deepseek_v3``: 6 layers of width 256, 5 of them mixtures of 8 experts whose weights are
    3-D stacks) on the job's assets, 2 x 64 tokens per rank and step, a checkpoint every 2
    steps, seeded, deterministic, trained by the scaleopt optimizer ``OPTIMIZER`` (with
    :data:`OPTIONS`)."""
    work = pathlib.Path(os.environ["JOB_DIR"])
    name = os.environ["OPTIMIZER"]
    family = os.environ.get("MODEL", "llama3")
    module, configs = {"llama3": (llama3, llama3_configs),
                       "deepseek_v3": (deepseek_v3, deepseek_v3_configs)}[family]
    config = getattr(configs, f"{family}_debugmodel")()
    config.model_spec = module.model_registry("debugmodel")
    config.hf_assets_path = str(work / "tokenizer")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                         dataset_path=str(work / "data"))
    options = dict(OPTIONS[name])
    if name == "Muon" and family == "deepseek_v3":
        # a CPU without bfloat16 matrix units (AVX-512 BF16, AMX) iterates this model's
        # matrices 36x slower in bfloat16 than in float32 (one step: 295 s against 8.1 s)
        options["ns_dtype"] = "float32"
    config.optimizer = optimizer_config(name, **options)
    config.training.local_batch_size = 2
    config.training.seq_len = 64
    config.training.steps = int(os.environ["STEPS"])
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.data_parallel_shard_degree = int(os.environ["WORLD_SIZE"])
    config.parallelism.expert_parallel_degree = int(os.environ.get("EP", "1"))
    config.validator.enable = False
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    config.checkpoint.folder = str(work / "checkpoints")
    config.dump_folder = str(work / "dump")
    config.debug.seed = 0
    config.debug.deterministic = True
    return config


if __name__ == "__main__":
    from torchtitan.train import main

    sys.argv = [sys.argv[0], "--module", "torchtitan_job", "--config", "scaleopt_debugmodel"]
    main()
