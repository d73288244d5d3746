"""Argument checks: each raises ``TypeError`` / ``ValueError`` naming the argument and its value."""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence, Tuple

import torch


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_number(
    name: str,
    value: Any,
    *,
    low: Optional[float] = 0.0,
    low_open: bool = False,
    high: Optional[float] = None,
    high_open: bool = True,
    allow_none: bool = False,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is a finite number in range."""
    if value is None and allow_none:
        return
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    bad = math.isnan(value) or math.isinf(value)
    if low is not None:
        bad = bad or value < low or (low_open and value == low)
    if high is not None:
        bad = bad or value > high or (high_open and value == high)
    if bad:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        rng = f"{lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number in {rng})")


def check_betas(value: Any, names: Tuple[str, str] = ("betas[0]", "betas[1]")) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {value!r}")
    for name, b in zip(names, value):
        check_number(name, b, low=0.0, high=1.0, high_open=True)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (choose one of {list(choices)})")


def check_optional_bool(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_name_rule(name: str, rule: Any) -> None:
    if rule is None or callable(rule) or isinstance(rule, str):
        rules = [] if rule is None or callable(rule) else [rule]
    elif isinstance(rule, (list, tuple)) and all(isinstance(r, str) for r in rule):
        rules = list(rule)
    else:
        raise TypeError(
            f"{name} must be None, a regex, a list of regexes or a callable(name) -> bool, "
            f"got {rule!r}"
        )
    for r in rules:
        try:
            re.compile(r)
        except re.error as exc:
            raise ValueError(f"Invalid {name}: {r!r} is not a valid regular expression ({exc})")


def checked_value_clip(cv: Any) -> Any:
    """``clip_grad_value`` checked: None, a positive number, or a ``(min, max)`` pair (as
    floats)."""
    if not isinstance(cv, (tuple, list)):
        check_number("clip_grad_value", cv, low=0.0, low_open=True, allow_none=True)
        return cv
    if len(cv) != 2:
        raise TypeError(f"clip_grad_value must be a number or a (min, max) pair, got {cv!r}")
    check_number("clip_grad_value[0]", cv[0], low=None)
    check_number("clip_grad_value[1]", cv[1], low=None)
    if not cv[0] < cv[1]:
        raise ValueError(f"Invalid clip_grad_value: {cv!r} (needs min < max)")
    return (float(cv[0]), float(cv[1]))


def check_bounds(lo: Any, hi: Any, lo_name: str = "lower_bound", hi_name: str = "upper_bound") -> None:
    check_number(lo_name, lo, low=0.0, low_open=True, allow_none=True)
    check_number(hi_name, hi, low=0.0, low_open=True, allow_none=True)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"Invalid {lo_name}/{hi_name}: {lo!r} > {hi!r}")


def check_same_sizes(kernel: str, weights: Sequence[Any], *others: Sequence[Any]) -> None:
    """Raise ``ValueError`` unless each tensor of ``others`` (lists beside ``weights``; None
    entries skipped) has as many elements as the weight at its place: a kernel addresses
    ``numel()`` elements of each tensor it is given, so a state tensor of another size would be
    read and written out of bounds."""
    numel = torch.Tensor.numel
    sizes = list(map(numel, weights))
    for tensors in others:
        try:
            got = list(map(numel, tensors))  # the common case, at C speed
        except TypeError:  # None entries: tensors the kernel does without
            got = [n if x is None else x.numel() for x, n in zip(tensors, sizes)]
        if got == sizes:
            continue
        for i, (w, x) in enumerate(zip(weights, tensors)):
            if x is not None and x.numel() != w.numel():
                raise ValueError(f"{kernel}: tensor {i} has {w.numel()} elements but a "
                                 f"{tuple(x.shape)} companion ({x.numel()}); state that does "
                                 f"not fit its parameter never reaches a kernel")



def check_num_threads(num_threads: Any) -> None:
    if num_threads is not None and (isinstance(num_threads, bool)
                                    or not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"Invalid num_threads: {num_threads!r} (a positive int or None)")


def edit_distance(a: str, b: str) -> int:
    """The number of single-character insertions, deletions, substitutions and swaps of two
    neighbours that turn ``a`` into ``b`` (the optimal string alignment distance)."""
    prev2: list = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def near_misses(key: str, options: Sequence[str]) -> list:
    """The options that ``key`` is a likely misspelling of: at most one edit away (two for keys
    of more than six characters), ignoring case, nearest first."""
    allowed = 2 if len(key) > 6 else 1
    scored = sorted((edit_distance(key.lower(), o.lower()), o) for o in options)
    return [o for d, o in scored if d <= allowed]
