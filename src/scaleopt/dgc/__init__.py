"""Deep Gradient Compression (Lin et al., ICLR 2018) over ``torch.distributed``.

:class:`DGCMomentum` communicates in ``step()``; :func:`ddp_comm_hook` with a
:class:`DGCHookState` does the same as a ``DistributedDataParallel`` communication hook;
:class:`ReplicaCompression` compresses the exchange between HSDP replicas for any optimizer.
"""

from .comm import PeerFailure
from .hook import DGCHookState, ReplicaCompression, ddp_comm_hook
from .optimizer import DGCMomentum
from .schedule import PAPER_SPARSITY, sparsity_at
from .select import k_of, topk_exact, topk_sampled

__all__ = ["DGCMomentum", "DGCHookState", "ReplicaCompression", "ddp_comm_hook", "PeerFailure",
           "PAPER_SPARSITY", "sparsity_at",
           "k_of", "topk_exact", "topk_sampled"]
