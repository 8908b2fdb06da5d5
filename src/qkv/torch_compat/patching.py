"""``patch(model)``: every ``torch.nn.MultiheadAttention`` in a model made a qkv
:class:`~qkv.torch_compat.MultiheadAttention`, in place."""

from __future__ import annotations

from torch import nn

from .module import MultiheadAttention, _keep_own_forward

__all__ = ["patch"]


def patch(model: nn.Module) -> nn.Module:
    """Make every ``torch.nn.MultiheadAttention`` in ``model`` a qkv :class:`MultiheadAttention`,
    in place: the same module objects, parameters, buffers and hooks, now computed by qkv.

    The modules stay where they are and keep their Parameter objects (an optimizer built
    before patching keeps working) and everything torch's module holds; only their class
    changes (as ``torch.nn.utils.parametrize`` changes a module's class). Outputs stay equal
    to torch's (except NaN rows, which become finite), ``need_weights=True`` gives weights
    from a fast kernel, and inside ``nn.TransformerEncoderLayer``/``nn.TransformerEncoder``
    the attention runs in qkv in every mode (torch's fused inference kernel is skipped for
    the patched layers). Patching twice changes nothing.

    Args:
        model: A module containing ``nn.MultiheadAttention`` modules, or one itself.

    Returns:
        ``model`` (when ``model`` is itself an ``nn.MultiheadAttention``, it is the patched
        module).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or holds a subclass of
            ``nn.MultiheadAttention`` whose own code a class change would drop.
        ValueError: ``model`` holds no ``nn.MultiheadAttention``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch needs a torch.nn.Module, got {type(model).__name__}")
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    foreign = [
        f"{name or '<model>'} ({type(m).__qualname__})"
        for name, m in found
        if type(m) not in (nn.MultiheadAttention, MultiheadAttention)
    ]
    if foreign:
        raise TypeError(
            f"patch replaces torch.nn.MultiheadAttention itself, but {', '.join(foreign)} "
            f"subclass it with code of their own that patching would drop; build those as "
            f"qkv.torch_compat.MultiheadAttention yourself, or patch a model without them"
        )
    if not found:
        raise ValueError(
            f"patch found no torch.nn.MultiheadAttention in {type(model).__name__}: nothing "
            f"to replace (qkv's own modules, e.g. qkv.MultiHeadAttention, need no patch)"
        )
    for _, m in found:
        m.__class__ = MultiheadAttention
        _keep_own_forward(m)
    return model
