import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():
    # Triton runs its kernels on CPU tensors only under its interpreter, which it reads when it
    # is imported (torch.compile may import it before any test of the Triton path runs)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
torch.set_num_threads(min(2, torch.get_num_threads()))
