"""Torch's process-wide settings, put back as they were when a function that changes them ends.

``torch.set_num_threads``, ``torch.manual_seed``, ``torch.set_default_dtype`` and the grad
mode outlive the call that set them: a benchmark run in-process with one thread left every
later test of the session on one thread, and a training run compared against a fresh process
then saw a different loss. Every library or command-line function of qkv that sets one of
them runs under :func:`preserve_torch_state`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TorchState", "preserve_torch_state"]


@dataclass(frozen=True)
class TorchState:
    """A snapshot of the settings :func:`preserve_torch_state` restores.

    Attributes:
        num_threads: ``torch.get_num_threads()``.
        default_dtype: ``torch.get_default_dtype()``.
        grad_enabled: ``torch.is_grad_enabled()``.
        deterministic: ``torch.are_deterministic_algorithms_enabled()``.
        rng: The CPU generator's state, ``torch.get_rng_state()``.
        cuda_rng: Every CUDA device's generator state, when CUDA is initialised (else None:
            reading it would initialise CUDA).
    """

    num_threads: int
    default_dtype: torch.dtype
    grad_enabled: bool
    deterministic: bool
    rng: Tensor
    cuda_rng: tuple[Tensor, ...] | None

    @classmethod
    def capture(cls) -> TorchState:
        """The settings now."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return cls(
            num_threads=torch.get_num_threads(),
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            rng=torch.get_rng_state(),
            cuda_rng=tuple(torch.cuda.get_rng_state_all()) if cuda else None,
        )

    def restore(self) -> None:
        """Put every setting back to this snapshot."""
        if torch.get_num_threads() != self.num_threads:  # setting it rebuilds the thread pool
            torch.set_num_threads(self.num_threads)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(list(self.cuda_rng))

    def same_as(self, other: TorchState) -> bool:
        """Whether ``other`` holds the same settings (RNG states compared by value)."""
        return (
            (self.num_threads, self.default_dtype, self.grad_enabled, self.deterministic)
            == (other.num_threads, other.default_dtype, other.grad_enabled, other.deterministic)
            and torch.equal(self.rng, other.rng)
            and _same_states(self.cuda_rng, other.cuda_rng)
        )


def _same_states(a: tuple[Tensor, ...] | None, b: tuple[Tensor, ...] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@contextmanager
def preserve_torch_state() -> Iterator[TorchState]:
    """Run the block, then restore torch's threads, default dtype, grad mode, deterministic
    flag and random number generators to what they were before it (also when it raises).

    Yields:
        The :class:`TorchState` from before the block.
    """
    before = TorchState.capture()
    try:
        yield before
    finally:
        before.restore()
