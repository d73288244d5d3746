"""``scaleopt.state_bytes``: what an optimizer holds between steps besides the parameters and
their gradients, counted from the tensors' shapes and dtypes."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _native

W, B = 256 * 256, 256  # a Linear(256, 256): its weight's and bias's elements


def _stepped(**options):
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    if options.pop("bf16", False):
        model = model.to(torch.bfloat16)
    opt = scaleopt.LAMB(model.parameters(), **options)
    model(torch.randn(4, 256, dtype=model.weight.dtype)).square().sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("form, weight_bytes", [
    ("float32", 8),  # two float32 moments
    ("bfloat16", 4),  # two bfloat16 moments
    ("int8", 2 + 2 * 4 / 256),  # int8 and uint8 codes, a float32 scale per block of 256 each
])
def test_the_moments_and_counters_of_each_state_dtype(form, weight_bytes):
    """The weight's moments in the form asked for, the bias's (256 elements: too small for
    another form) in float32, and a float32 step counter per tensor."""
    model, opt = _stepped(state_dtype=form)
    held = scaleopt.state_bytes(opt)
    expected = W * weight_bytes + B * 8 + 2 * 4
    assert held == (expected, expected, W + B)
    assert held.per_param == pytest.approx(expected / (W + B))


@pytest.mark.skipif(not _native.available(), reason="split masters need the C kernels")
def test_parameters_and_gradients_are_not_counted_and_a_split_master_is():
    """bfloat16 parameters with master weights: their float32 moments and the masters' lower
    halves (int16) are held; the parameters (the masters' upper halves) and their gradients
    are the model's."""
    model, opt = _stepped(bf16=True, master_weights=True)
    assert "master_lo" in opt.state[model.weight]
    assert scaleopt.state_bytes(opt).per_rank == (W + B) * (8 + 2) + 2 * 4


def test_a_storage_held_twice_counts_once_and_attributes_count():
    """A tensor reachable twice (the state and an attribute of the optimizer) counts once; a
    tensor only an attribute holds counts."""
    model, opt = _stepped()
    before = scaleopt.state_bytes(opt).per_rank
    opt.again = [opt.state[model.weight]["exp_avg"]]
    opt.extra = {"buffer": torch.zeros(100)}
    assert scaleopt.state_bytes(opt).per_rank == before + 400


def test_counters_that_share_one_buffer_count_once(monkeypatch):
    """On the Triton path (here under its interpreter) a group's counters point into one
    buffer: it counts once, as many bytes as the counters of separate tensors."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors run under TRITON_INTERPRET=1")
    model, opt = _stepped(implementation="triton")
    steps = [st["step"] for st in opt.state.values()]
    assert steps[0].untyped_storage().data_ptr() == steps[1].untyped_storage().data_ptr()
    _, single = _stepped(implementation="single")
    assert scaleopt.state_bytes(opt) == scaleopt.state_bytes(single)
