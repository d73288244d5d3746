import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
torch.set_num_threads(min(2, torch.get_num_threads()))
