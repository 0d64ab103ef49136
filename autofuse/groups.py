"""torch.distributed process groups as a captured graph names them (a functional collective's ``group_name``).

Shared by the MC2 patterns (a reduce-scatter's world size), the lowering of unfused collectives and the
simulator's links (a real process group to exchange data over); no import of torch.distributed until called.
"""
from __future__ import annotations


def resolve_group(name):
    """The torch.distributed process group a functional collective names (its ``group_name`` argument), or None
    when it cannot be resolved in this process (torch.distributed not initialised, or an unknown name)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    try:
        return _resolve_process_group(name)
    except (ValueError, RuntimeError, KeyError):
        return None


def group_size(name) -> int | None:
    """The number of ranks of the process group ``name`` (see :func:`resolve_group`), or None."""
    group = resolve_group(name)
    if group is None:
        return None
    import torch.distributed as dist
    return dist.get_world_size(group)


__all__ = ["group_size", "resolve_group"]
