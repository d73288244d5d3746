"""scaleopt with PyTorch Lightning: ``configure_optimizers``, mixed precision, clipping, resume.

* ``configure_optimizers`` returns a scaleopt optimizer (and a scheduler) like any other.
* Mixed precision: ``precision="bf16-mixed"`` needs nothing more. With ``"16-mixed"`` Lightning
  scales the loss; ``gradient_clip_val`` works with every scaleopt optimizer (Lightning
  unscales through its GradScaler before it clips). The optimizer's own ``max_grad_norm``
  clips the unscaled gradients inside the step instead, with one pass less.
* Clipping in general: ``gradient_clip_val`` (Lightning clips before ``step()``) and the
  optimizers' ``max_grad_norm`` (inside ``step()``; with LAMB/LANS also the fused CPU kernels)
  compute the same; use one of them, not both.
* Checkpoints: Lightning saves ``opt.state_dict()`` and resumes with ``load_state_dict``; the
  resumed run equals the uninterrupted one bit for bit.

Run: ``python docs/recipes/lightning_lamb.py OUT_DIR`` (needs ``pip install scaleopt[frameworks]``).
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.nn.functional as F

import scaleopt


def data(n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, optimizer="lamb", lr=1e-2, max_steps=8, **options):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64),
                                       torch.nn.GELU(), torch.nn.Linear(64, 4))
        self.optimizer, self.lr, self.max_steps, self.options = optimizer, lr, max_steps, options

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        groups = scaleopt.param_groups(self, weight_decay=0.01)  # no decay for biases and norms
        if self.optimizer == "lamb":
            opt = scaleopt.LAMB(groups, lr=self.lr, **self.options)
        elif self.optimizer == "offload-adam":
            opt = scaleopt.OffloadAdam(groups, lr=self.lr, **self.options)
        elif self.optimizer == "sgd":  # plain SGD, e.g. after the DGC hook (lightning_dgc.py)
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            raise ValueError(self.optimizer)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / self.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(out, max_steps=8, ckpt_path=None, precision="32-true", clip=None, **module_options):
    """Train (or resume from ``ckpt_path``) to ``max_steps`` (4 steps an epoch), a checkpoint
    after every 4 steps (at the end of an epoch) in ``out``, with Lightning's
    ``gradient_clip_val=clip``; the module. (A checkpoint in the middle of an epoch resumes
    exactly only with a resumable data loader.)"""
    module = Classifier(max_steps=max_steps, **module_options)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=4,
                                                      save_top_k=-1)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, precision=precision,
                        callbacks=[checkpoints], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, gradient_clip_val=clip)
    loader = torch.utils.data.DataLoader(data(), batch_size=128)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "lightning-lamb"
    module = fit(out)
    print(f"trained; checkpoints in {out}")
