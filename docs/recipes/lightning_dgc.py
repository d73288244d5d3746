"""Deep Gradient Compression under Lightning's DDP, on CPUs (gloo) or GPUs (NCCL).

Lightning passes ``DDPStrategy(ddp_comm_hook=...)`` to DDP on GPUs only; on CPUs it trains
without the hook and says nothing. :class:`DGCCallback` registers ``scaleopt.dgc.ddp_comm_hook``
itself, on every device, once Lightning has wrapped the model in DDP.

Checkpoints: the hook's residuals differ from rank to rank, and Lightning writes the checkpoint
from rank 0 only. The callback gathers every rank's :meth:`DGCHookState.state_dict` into the
checkpoint (``checkpoint["dgc_hook_states"]``, one entry per rank) and gives each rank its own
back on resume, so a resumed run continues the uninterrupted one bit for bit. The gathered
residuals take world-size x the model's float32 bytes on rank 0 while it saves.

Run: ``python docs/recipes/lightning_dgc.py OUT_DIR`` (2 CPU processes; needs
``pip install scaleopt[frameworks]``).
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.distributed as dist

from scaleopt.dgc import DGCHookState, ddp_comm_hook

from lightning_lamb import Classifier, data


class DGCCallback(L.Callback):
    """Register the DGC communication hook on Lightning's DDP model, and keep every rank's
    residuals in Lightning's checkpoints. ``options``: those of :class:`DGCHookState`."""

    def __init__(self, **options):
        self.options = options
        self.state = None
        self._saved = None  # every rank's state, from the checkpoint being resumed

    def on_fit_start(self, trainer, pl_module):
        ddp = trainer.strategy.model
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError("DGCCallback needs a DDP strategy (strategy='ddp' or 'ddp_spawn')")
        self.state = DGCHookState(ddp, **self.options)
        ddp.register_comm_hook(self.state, ddp_comm_hook)
        if self._saved is not None:
            self.state.load_state_dict(self._saved[trainer.global_rank])

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        states = [None] * trainer.world_size  # every rank calls this hook: gather to each
        dist.all_gather_object(states, self.state.state_dict())
        checkpoint["dgc_hook_states"] = states

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._saved = checkpoint.get("dgc_hook_states")


class EndTogether(L.Callback):
    """End the process group on every rank at once. Lightning leaves it to an atexit handler in
    each process, so a rank may tear gloo down while another still works (rank 0 saves the
    weights for ``ddp_spawn``), which can abort that rank ("terminate called without an active
    exception"), with or without DGC."""

    def teardown(self, trainer, pl_module, stage):
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def fit(out, max_steps=8, ckpt_path=None, dgc=True, workers=2, **dgc_options):
    """Momentum SGD under Lightning DDP on ``workers`` CPU processes (``ddp_spawn``), with the DGC
    hook unless ``dgc=False``; a checkpoint after every 4 steps in ``out``. The module, with
    rank 0's trained weights."""
    module = Classifier(optimizer="sgd", lr=0.05, max_steps=max_steps)
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=4,
                                                     save_top_k=-1), EndTogether()]
    if dgc:
        callbacks.append(DGCCallback(**{"momentum": 0.9, "sparsity": [0.9], "min_numel": 64,
                                        **dgc_options}))
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=workers,
                        strategy="ddp_spawn", callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=64), ckpt_path=ckpt_path)
    return module


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "lightning-dgc"
    fit(out)
    print(f"trained with DGC on 2 processes; checkpoints in {out}")
