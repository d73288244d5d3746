"""``python -m scaleopt``: the ``scaleopt`` command."""

from .cli import console

console()
