"""Loading and replaying the golden cases recorded from the reference frameworks."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Dict, List

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent.parent  # tests/
BUNDLED = HERE / "data" / "oracle"
SHARED = HERE.parent.parent / "shared" / "oracle" / "cases"


def case_files(prefixes) -> List[pathlib.Path]:
    """Bundled cases plus any further case of the same families found in ../shared/oracle."""
    found: Dict[str, pathlib.Path] = {}
    for folder in (BUNDLED, SHARED):
        if folder.is_dir():
            for f in sorted(folder.glob("*.json")):
                if f.name.startswith(tuple(prefixes)):
                    found.setdefault(f.name, f)
    return [found[k] for k in sorted(found)]


def load(path: pathlib.Path) -> Dict[str, Any]:
    return json.loads(path.read_text())


def _tensor(values, shape, dtype=torch.float32):
    vals = [float("nan") if v is None else v for v in values]
    return torch.tensor(vals, dtype=dtype).reshape(shape)


def make_params(case: Dict[str, Any]) -> Dict[str, torch.nn.Parameter]:
    return {
        n: torch.nn.Parameter(_tensor(case["params"][n]["init"], case["params"][n]["shape"]))
        for n in case["param_order"]
    }


def replay(case: Dict[str, Any], params: Dict[str, torch.nn.Parameter], step: Callable[[], None],
           state_of: Callable[[torch.Tensor], Dict[str, torch.Tensor]] = None,
           rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Feed each recorded gradient, step, and compare parameters (and m, v) with the record."""
    for t, rec in enumerate(case["steps"]):
        for n, p in params.items():
            p.grad = _tensor(rec["grads"][n], p.shape)
        step()
        for n, p in params.items():
            want = _tensor(rec["params_after"][n], p.shape)
            torch.testing.assert_close(
                p.detach(), want, rtol=rtol, atol=atol, equal_nan=True,
                msg=lambda m, n=n, t=t: f"{case['case']}: {n} after step {t + 1}: {m}",
            )
            if state_of is not None and "state_after" in rec and n in rec["state_after"]:
                got = state_of(p)
                for key, values in rec["state_after"][n].items():
                    assert key in got, f"{case['case']}: no state {key!r} to compare"
                    torch.testing.assert_close(
                        got[key], _tensor(values, p.shape), rtol=rtol, atol=atol,
                        equal_nan=True,
                        msg=lambda m, n=n, t=t, key=key: f"{case['case']}: state {key} of {n} "
                        f"after step {t + 1}: {m}",
                    )


def assert_variant_misses(case: Dict[str, Any], params: Dict[str, torch.nn.Parameter], opt,
                          change: Dict[str, Any]) -> None:
    """``opt`` with its groups' options changed by ``change`` does not reproduce ``case``: the
    replay is sharp enough to tell the reference's semantics from a near miss."""
    for g in opt.param_groups:
        g.update(change)
    with pytest.raises(AssertionError):
        replay(case, params, opt.step)
