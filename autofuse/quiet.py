"""Warnings from torch internals that tell an autofuse user nothing, silenced at the call that raises them.

Every capture used to print::

    FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and
    treespec.is_leaf()` instead.

It comes from ``torch.export.ExportedProgram.run_decompositions`` (called by :func:`autofuse.capture.capture`
on the export route): ``_decompose_exported_program`` -> ``_get_updated_module_call_graph`` deep-copies the
module call graph, and copying a pytree ``LeafSpec`` calls ``LeafSpec.__new__``, which torch 2.13 marks
deprecated with ``typing_extensions.deprecated``. Nothing in autofuse or the user's model uses
``LeafSpec``; the filter below matches that one message only, so every other warning still shows.

A forward that assigns a tensor to a module attribute makes torch.export warn that it "must be registered as
buffers"; capture then refuses that forward by name with its own error (:func:`autofuse.capture.capture`), so the
warning is silenced too: the error says it, and what to do. An RNN's forward rebuilds its list of its own parameters
when traced, which capture puts back (nothing for the user to do).

A symbolic export (:mod:`autofuse.sizes`, the export that serves the signatures of one structure at other sizes)
marks the dims seen to change ``Dim.AUTO``; where one of them is 1 in the call exported, torch logs (WARNING) that
it "0/1 specialized" it. The export then keeps that size, and a call at another is exported again: the log says
nothing a user can act on, so :func:`symbolic_export_logs` drops that one message.
"""
from __future__ import annotations

import contextlib
import warnings

LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
ATTRIBUTE_MESSAGE = r"The tensor attributes? .* (was|were) assigned during export"


@contextlib.contextmanager
def torch_internal_warnings():
    """Within the block, ignore the deprecation torch raises against itself while capturing (see above)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAFSPEC_MESSAGE, category=FutureWarning)
        warnings.filterwarnings("ignore", message=ATTRIBUTE_MESSAGE, category=UserWarning)
        yield


SPECIALIZED_MESSAGE = "0/1 specialized; Dim.AUTO was specified"


@contextlib.contextmanager
def symbolic_export_logs():
    """Within the block, drop torch's log that a ``Dim.AUTO`` dim of size 1 was specialised (see above)."""
    import logging
    log = logging.getLogger("torch._export.non_strict_utils")

    def drop(record) -> bool:           # a logging filter may be a plain function
        return SPECIALIZED_MESSAGE not in record.getMessage()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)
