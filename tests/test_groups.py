"""scaleopt.param_groups: no decay on biases and normalisation weights, as few groups as possible."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaleopt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2, bias=False)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)


def test_split_into_decay_and_no_decay():
    groups = scaleopt.param_groups(Net(), weight_decay=0.05)
    assert len(groups) == 2
    decay, plain = groups
    assert decay["weight_decay"] == 0.05 and plain["weight_decay"] == 0.0
    assert decay["param_names"] == ["emb.weight", "proj.weight", "head.weight"]
    assert plain["param_names"] == ["proj.bias", "ln.weight", "ln.bias", "bn.weight", "bn.bias"]
    assert all(len(g["params"]) == len(g["param_names"]) for g in groups)


def test_rule_and_options():
    groups = scaleopt.param_groups(Net(), weight_decay=0.1, no_decay=[r"^emb\."], lr=0.5)
    assert "emb.weight" in groups[1]["param_names"]
    assert all(g["lr"] == 0.5 for g in groups)
    groups = scaleopt.param_groups(Net(), no_decay=lambda n: n.startswith("head"))
    assert "head.weight" in groups[1]["param_names"]


def test_empty_groups_are_dropped():
    groups = scaleopt.param_groups(nn.Linear(3, 3, bias=False))
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.01


def test_norm_weight_with_two_dims_is_still_not_decayed():
    class Norm2d(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2, 3))

    m = nn.Sequential(Norm2d(), nn.Linear(3, 3))
    names = scaleopt.param_groups(m)[1]["param_names"]
    assert "0.weight" in names


def test_groups_drive_an_optimizer_and_name_rules_work():
    model = Net()
    opt = scaleopt.LAMB(scaleopt.param_groups(model), exclude_from_layer_adaptation=["emb"])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    x = torch.randint(0, 10, (8,))
    model.train()
    model.head(model.bn(model.ln(model.proj(model.emb(x))))).sum().backward()
    opt.step()
    assert opt.state[model.emb.weight]["step"].item() == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="weight_decay"):
        scaleopt.param_groups(Net(), weight_decay=-1.0)
    with pytest.raises(TypeError, match="no_decay"):
        scaleopt.param_groups(Net(), no_decay=5)
