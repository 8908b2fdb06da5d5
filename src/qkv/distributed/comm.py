"""The messages of qkv.distributed: posting them, waiting with a deadline, and a log of them.

Every wait has a deadline when the caller gives ``timeout`` (seconds): a peer that died, or
never made the same call, then raises :class:`PeerError` on the ranks waiting for it instead
of hanging them. Without one, torch's process-group timeout applies (set by
``init_process_group(timeout=...)``; 30 minutes by default on CPU).

:func:`comm_log` records every message a rank sends and receives (peer, bytes, phase), for
tests that check a skipped shard is never sent and for benchmarks of communication volume.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor

__all__ = ["CommLog", "Message", "PeerError", "comm_log", "exchange", "wait"]


class PeerError(RuntimeError):
    """A message or collective of qkv.distributed did not complete: a rank died, timed out or
    did not make the same call."""


@dataclass(frozen=True)
class Message:
    """One point-to-point message: ``kind`` "send" or "recv", ``peer`` the other rank (in the
    group), ``nbytes``, ``phase`` ("forward", "backward" or "gradients") and ring ``step``."""

    kind: str
    peer: int
    nbytes: int
    phase: str
    step: int


@dataclass
class CommLog:
    """The messages of the calls made inside :func:`comm_log`, on this rank."""

    messages: list[Message] = field(default_factory=list)

    def bytes(self, kind: str = "send", phase: str | None = None) -> int:
        """Bytes sent (or received) in all, or in one phase."""
        return sum(
            m.nbytes
            for m in self.messages
            if m.kind == kind and (phase is None or m.phase == phase)
        )

    def peers(self, kind: str = "send", phase: str | None = None) -> set[int]:
        """The ranks this rank sent to (or received from)."""
        return {
            m.peer for m in self.messages if m.kind == kind and (phase is None or m.phase == phase)
        }


_LOG: contextvars.ContextVar[CommLog | None] = contextvars.ContextVar("qkv_comm_log", default=None)


@contextlib.contextmanager
def comm_log():
    """Record this rank's messages in the block.

    Example:
        >>> with qkv.distributed.comm_log() as log:
        ...     window = qkv.masks.sliding_window(256)
        ...     out = qkv.distributed.ring_attention(q, k, v, mask_mod=window)
        >>> log.bytes("send"), log.peers("recv")
    """
    log = CommLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def wait(work, timeout: float | None, what: str) -> None:
    """Wait for ``work``; a failure or a missed deadline raises :class:`PeerError` saying what
    was waited for. ``work`` may be a function that posts the operation: gloo can raise while
    posting ("Connection closed by peer") when a peer is already gone, and that is the same
    story."""
    try:
        if callable(work):
            work = work()
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except Exception as err:  # torch raises RuntimeError or DistBackendError
        raise _peer_error(what, timeout, err) from err


def _peer_error(what: str, timeout: float | None, err: Exception) -> PeerError:
    limit = f"within {timeout:g} s" if timeout is not None else "(process-group timeout)"
    return PeerError(
        f"qkv.distributed: {what} did not complete {limit}: a rank died or timed out, or "
        f"not every rank of the group made the same call with the same arguments "
        f"({type(err).__name__}: {err})"
    )


class Pending:
    """Messages in flight; :meth:`wait` waits for all of them."""

    def __init__(self, works: list, timeout: float | None, what: str) -> None:
        self.works, self.timeout, self.what = works, timeout, what

    def wait(self) -> None:
        for work in self.works:
            wait(work, self.timeout, self.what)
        self.works = []


def exchange(
    group,
    sends: list[tuple[Tensor, int]],
    recvs: list[tuple[Tensor, int]],
    *,
    tag: int,
    phase: str,
    step: int,
    timeout: float | None,
) -> Pending:
    """Post ``sends`` (tensor, peer) and ``recvs`` (buffer, peer) at once; peers are ranks in
    ``group``. Both sides pass the same ``tag``, and list the messages between two ranks in
    the same order: the i-th message to a peer meets the i-th one expected from it (each gets
    its own tag, ``8 * tag + i``)."""
    log = _LOG.get()
    ops = []
    for kind, items, fn in (("send", sends, dist.isend), ("recv", recvs, dist.irecv)):
        nth: dict[int, int] = {}
        for tensor, peer in items:
            i = nth[peer] = nth.get(peer, -1) + 1
            ops.append(dist.P2POp(fn, tensor, group=group, group_peer=peer, tag=8 * tag + i))
            if log is not None:
                log.messages.append(
                    Message(kind, peer, tensor.numel() * tensor.element_size(), phase, step)
                )
    what = f"the {phase} messages of ring step {step}"
    try:
        works = dist.batch_isend_irecv(ops) if ops else []
    except Exception as err:  # posting fails when a peer is already gone
        raise _peer_error(what, timeout, err) from err
    return Pending(works, timeout, what)
