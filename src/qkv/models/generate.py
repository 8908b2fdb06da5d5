"""Choosing tokens and the decoding loop shared by the generating models.

Greedy decoding takes the argmax; sampling draws from ``softmax(logits / temperature)``,
restricted to the ``top_k`` largest logits when given, with a ``torch.Generator`` seeded by
``seed`` (never the global RNG, so a seed gives the same tokens whatever else runs).

Shape alphabet: B batch, V vocabulary, N new tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["TokenChooser"]


class TokenChooser:
    """Picks the next token from logits: greedy, or sampled with temperature and top-k.

    Args:
        greedy: Take the argmax (then temperature, top_k and seed must stay unset).
        temperature: Divides the logits before the softmax; > 0.
        top_k: Sample among the k largest logits only (``top_k=1`` is greedy); clipped to V.
        seed: Seed of the sampling generator; None draws a fresh seed from the OS.

    Shape:
        ``chooser(logits)``: ``(B, V)`` -> ``(B,)`` int64.
    """

    def __init__(
        self,
        *,
        greedy: bool = True,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> None:
        if greedy and (temperature != 1.0 or top_k is not None or seed is not None):
            raise ValueError(
                "greedy decoding takes the argmax: temperature, top_k and seed "
                "apply to sampling only; pass greedy=False to sample"
            )
        if not (
            isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
        ):
            raise ValueError(
                f"temperature must be a finite number > 0, got {temperature!r} "
                f"(for the argmax use greedy=True)"
            )
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0
        ):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.greedy, self.temperature, self.top_k, self.seed = greedy, temperature, top_k, seed
        self._generator: torch.Generator | None = None

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()  # nondeterministic, and still not the global generator
            else:
                g.manual_seed(self.seed)
            self._generator = g
        return self._generator

    def __call__(self, logits: Tensor) -> Tensor:
        if self.greedy:
            return logits.argmax(-1)  # (B,)
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if self.top_k is not None:
            logits, index = logits.topk(min(self.top_k, logits.shape[-1]), -1)  # (B, k) x2
        else:
            index = None
        probs = torch.softmax(logits / self.temperature, -1)  # (B, V) or (B, k)
        pick = torch.multinomial(probs, 1, generator=self._rng(probs.device))  # (B, 1)
        return (pick if index is None else index.gather(-1, pick))[:, 0]  # (B,)


@torch.no_grad()
def decode_loop(
    step: Callable[[Tensor], Tensor],
    logits: Tensor,
    max_new_tokens: int,
    *,
    choose: TokenChooser,
    eos: int | None,
    pad: int,
) -> Tensor:
    """Choose ``max_new_tokens`` tokens, feeding each back through ``step``.

    ``logits`` are those of the last prompt position; ``step(tokens (B, 1))`` returns the
    logits of the next position. A sequence that has emitted ``eos`` emits ``pad`` after it;
    when all have, the loop stops and the rest is ``pad``.

    Shape:
        logits ``(B, V)`` -> ``(B, N)``.
    """
    B = logits.shape[0]
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=logits.device)  # (B, N)
    done = torch.zeros(B, dtype=torch.bool, device=logits.device)  # (B,)
    for i in range(max_new_tokens):
        token = choose(logits).masked_fill(done, pad)  # (B,)
        out[:, i] = token
        if eos is not None:
            done |= token == eos
        if i + 1 == max_new_tokens or bool(done.all()):
            break
        logits = step(token[:, None])  # (B, V)
    return out


def check_generate(
    max_new_tokens: int, eos: int | None, pad: int, vocab_size: int, *, bos: int | None = None
) -> None:
    """Validate the arguments every ``generate`` shares (token ids: eos and bos may be None)."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens <= 0
    ):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    for name, t in (("eos", eos), ("pad", pad), ("bos", bos)):
        if t is None and name != "pad":
            continue
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{name} must be a token id in [0, {vocab_size}), got {t!r}")
