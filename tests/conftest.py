import inspect
import os
import pathlib
import re
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
if "OMP_NUM_THREADS" not in os.environ:  # (a thread count asked for is the one the tests run at)
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A LAMB run of ``runs.SMALL`` stopped at step 4 of 12 with checkpoints at steps 2 and 4."""
    from runs import train

    run = tmp_path_factory.mktemp("trust") / "lamb"
    train(run, "--checkpoint-every", "2", "--stop-after", "4")
    return run


@pytest.fixture(scope="module")
def as_workers():
    """The module's one-process references at the thread count of the multi-process tests'
    workers (``dgc_workers.THREADS``), so that "one process's bits" compares like with like
    (``pytestmark = pytest.mark.usefixtures("as_workers")`` in a module)."""
    import dgc_workers

    with dgc_workers.as_a_worker():
        yield


#: what makes a test a comparison of bits or of tight tolerances (marked ``bits``: .ci/run runs
#: them once more at other thread counts, BLAS paths and CPU kernels): its name says bits, or
#: its code compares with ``torch.equal``, a zero tolerance, an ``atol`` below 1e-6, the
#: tolerance of ``close.assert_within_steps`` or a helper that asserts equal bits
_BITS_NAME = re.compile(r"bit|same_codes|identical|exactly|as_one_process|equal")
_BITS_CODE = re.compile(r"torch\.equal\(|rtol=0[,)]|atol=0[,)]|assert_within_steps|_same_bits\(|"
                        r"assert_same_run\(|\.tolist\(\) ==|atol=(\d(\.\d*)?e-(\d+))")


def _compares_bits(item) -> bool:
    if _BITS_NAME.search(item.originalname if hasattr(item, "originalname") else item.name):
        return True
    try:
        code = inspect.getsource(item.obj)
    except (OSError, TypeError):
        return False
    for m in _BITS_CODE.finditer(code):
        if m.group(1) is None or float(m.group(1)) < 1e-6:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _compares_bits(item):
            item.add_marker(pytest.mark.bits)
