"""Autograd-only graph ops: they change how the gradient flows, not a value, and run no kernel on the NPU.

``torch.ops.autofuse_grad.pass_gradient(value, source)`` is ``value`` whose gradient goes to ``source``
unchanged (the two have one shape and dtype). It stands where eager's autograd would not see an update: a
tensor made with a gradient and then updated in place inside the forward's own ``torch.no_grad()`` block
(``h.clamp_(-1, 1)``, ``h[:, :3] = 0``). Eager records no such update, so what reads ``h`` after the block gets
the new values and passes its gradient to ``h``'s history as if nothing had happened; a functional graph holds
the update as new nodes, which :func:`autofuse.capture._detach_grad_free_blocks` reads through this op. It is
free on the simulated NPU (a view, as ``detach``), and canonicalize drops it from a graph that runs without grad.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("autofuse_grad::pass_gradient", mutates_args=())
def pass_gradient(value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return value.clone()        # a custom op returns no alias of its inputs


@pass_gradient.register_fake
def _(value, source):
    return torch.empty_like(value)


def _backward(ctx, grad):
    return None, grad


pass_gradient.register_autograd(_backward)

PASS_GRADIENT = torch.ops.autofuse_grad.pass_gradient.default


def no_double_backward(op, what: str, *families: str) -> None:
    """Give ``op``, a fused block's backward op with no derivative of its own, an autograd formula that says so by
    name: a gradient of its gradient (``create_graph=True``, then a gradient penalty) raises this instead of torch's
    "no autograd formula was registered". ``families``: the fusion switches that leave such blocks unfused."""
    switches = ", ".join(f"'{f}': 'off'" for f in families)
    def backward(ctx, *grads):
        raise RuntimeError(f"autofuse: a gradient of the gradient (create_graph=True, then differentiating the result) "
                           f"through {what} is not supported: its backward ({op._name}) has no derivative. hint: "
                           f"fuse with fusion_switches={{{switches}}} for that, or run the model eagerly")

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
