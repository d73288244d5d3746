"""The examples in the docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "scaleopt.lamb",
    "scaleopt.lans",
    "scaleopt.compat.mxnet",
    "scaleopt.adamw",
    "scaleopt.momentum",
    "scaleopt.groups",
    "scaleopt.compat.paddle",
    "scaleopt.compat.keras",
    "scaleopt.compat.tf1",
    "scaleopt.offload",
    "scaleopt.compat.mindspore",
    "scaleopt.dgc.optimizer",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    import torch

    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0


@pytest.mark.parametrize("name", ["LAMB", "LANS", "AdamW", "Momentum", "OffloadAdam", "DGCMomentum"])
def test_docstrings_name_every_argument(name):
    import inspect

    import scaleopt

    cls = getattr(scaleopt, name)
    doc = cls.__doc__
    for arg in inspect.signature(cls.__init__).parameters:
        if arg not in ("self",):
            assert arg in doc, f"{name} docstring does not describe {arg}"
