"""Front-ends with the reference frameworks' own class and argument names.

``scaleopt.compat.paddle``, ``scaleopt.compat.mxnet``, ``scaleopt.compat.mindspore``,
``scaleopt.compat.keras`` and ``scaleopt.compat.tf1`` hold thin
classes on the scaleopt core that reproduce those frameworks' optimizers, numbers included, for
porting training scripts.
"""

from . import keras, mindspore, mxnet, paddle, tf1

__all__ = ["paddle", "mxnet", "mindspore", "keras", "tf1"]
