import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton runs its kernels on CPU tensors only under its interpreter, which it reads when it
    # is imported (torch.compile may import it before any test of the Triton path runs)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the test files' shared helpers and the workers of the multi-process tests (tests/helpers),
# imported by name in the tests and in the workers they start
HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "helpers"), str(HERE)]
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A LAMB run of ``runs.SMALL`` stopped at step 4 of 12 with checkpoints at steps 2 and 4."""
    from runs import train

    run = tmp_path_factory.mktemp("trust") / "lamb"
    train(run, "--checkpoint-every", "2", "--stop-after", "4")
    return run
