"""Warnings from torch internals that tell an autofuse user nothing, silenced at the call that raises them.

Every capture used to print::

    FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and
    treespec.is_leaf()` instead.

It comes from ``torch.export.ExportedProgram.run_decompositions`` (called by :func:`autofuse.capture.capture`
on the export route): ``_decompose_exported_program`` -> ``_get_updated_module_call_graph`` deep-copies the
module call graph, and copying a pytree ``LeafSpec`` calls ``LeafSpec.__new__``, which torch 2.13 marks
deprecated with ``typing_extensions.deprecated``. Nothing in autofuse or the user's model uses
``LeafSpec``; the filter below matches that one message only, so every other warning still shows.
"""
from __future__ import annotations

import contextlib
import warnings

LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


@contextlib.contextmanager
def torch_internal_warnings():
    """Within the block, ignore the deprecation torch raises against itself while capturing (see above)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAFSPEC_MESSAGE, category=FutureWarning)
        yield
