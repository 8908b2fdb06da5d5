"""qkv on torch.distributed: attention over a sequence sharded across processes.

* :func:`ring_attention`: exact attention of a sharded sequence (context parallel), forward
  and backward, with qkv's masks and score mods over whole-sequence positions; shards the mask
  leaves empty for a rank are never sent to it.
* :func:`shard` / :func:`unshard`: cut a whole sequence into this rank's shard and put it back
  together, ``"contiguous"`` or ``"balanced"`` (causal load balancing).
* :func:`comm_log`: what a rank sent and received, message by message.
* :func:`run_local`: run a function on R local processes in a gloo group (tests, examples).

Run under ``torchrun`` (or after ``torch.distributed.init_process_group``): gloo with CPU
tensors, NCCL with CUDA tensors.
"""

from .comm import CommLog, Message, PeerError, comm_log
from .layout import LAYOUTS, segments, shard, unshard
from .local import RankFailed, run_local
from .ring import ring_attention

__all__ = [
    "LAYOUTS",
    "CommLog",
    "Message",
    "PeerError",
    "RankFailed",
    "comm_log",
    "ring_attention",
    "run_local",
    "segments",
    "shard",
    "unshard",
]
