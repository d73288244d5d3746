"""A rank of a shaped-link cluster's world (run as a script inside a node's namespace): an
all-reduce of ``numel`` float32 ones; writes the sum it got to ``out/rank<R>.txt``."""

import datetime
import os
import sys

import torch
import torch.distributed as dist


def main(out: str, numel: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    x = torch.ones(numel)
    dist.all_reduce(x)
    with open(os.path.join(out, f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{float(x.min())} {float(x.max())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
