"""scaleopt with Hugging Face ``Trainer``: LAMB on a small BERT masked-language model.

Two ways to hand the optimizer to the Trainer:

* ``optimizers=(opt, scheduler)``: you build the optimizer, with your own param groups
  (``scaleopt.param_groups`` gives weight decay to the weight matrices only);
* ``optimizer_cls_and_kwargs=(scaleopt.LAMB, kwargs)``: the Trainer builds the groups, with
  ``TrainingArguments.weight_decay`` for the decayed ones. Its default is 0.0, and LAMB
  (``always_adapt=False``) applies its trust ratio only to tensors with weight decay, so with
  the default no tensor takes it and LAMB computes Adam (scaleopt warns once). Set
  ``weight_decay`` in the arguments, or pass ``always_adapt=True``.

Checkpoints: the Trainer saves ``optimizer.pt`` from ``opt.state_dict()`` and resumes with
``load_state_dict``; the resumed run equals the uninterrupted one bit for bit.

Run: ``python docs/recipes/hf_trainer.py OUT_DIR`` (needs ``pip install scaleopt[frameworks]``).
"""

from __future__ import annotations

import sys

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

import scaleopt


class Tokens(torch.utils.data.Dataset):
    """Generated sequences of token ids; every 4th token masked (label = the original id)."""

    def __init__(self, n=256, length=16, vocab=128, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i].clone()
        labels = torch.full_like(ids, -100)
        labels[::4] = ids[::4]
        ids[::4] = 4  # the [MASK] id
        return {"input_ids": ids, "labels": labels}


def tiny_bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128,
                        max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)


def arguments(out, max_steps=6, save_steps=3, weight_decay=0.0):
    return TrainingArguments(output_dir=out, max_steps=max_steps, save_steps=save_steps,
                             per_device_train_batch_size=16, learning_rate=1e-3,
                             weight_decay=weight_decay, lr_scheduler_type="linear",
                             warmup_steps=2, use_cpu=True, report_to=[], logging_steps=1,
                             seed=0, disable_tqdm=True, save_only_model=False)


def train_with_optimizers(out, resume=None, max_steps=6):
    """``optimizers=(opt, scheduler)``: LAMB on scaleopt's param groups."""
    model = tiny_bert()
    args = arguments(out, max_steps)
    opt = scaleopt.LAMB(scaleopt.param_groups(model, weight_decay=0.01), lr=args.learning_rate)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 2) * max(0.0, 1 - s / max_steps))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def train_with_cls_and_kwargs(out, weight_decay=0.01, resume=None, max_steps=6, **kwargs):
    """``optimizer_cls_and_kwargs``: the Trainer builds the groups (``weight_decay`` from the
    arguments, none for biases and LayerNorm weights)."""
    model = tiny_bert()
    args = arguments(out, max_steps, weight_decay=weight_decay)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      optimizer_cls_and_kwargs=(scaleopt.LAMB, dict(kwargs)))
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "hf-lamb"
    model, trainer = train_with_optimizers(out)
    print(f"trained {trainer.state.global_step} steps; loss {trainer.state.log_history[-2]['loss']}")
