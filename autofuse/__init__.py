"""autofuse: graph-level auto-fusion compiler for PyTorch on Cube/Vector NPUs."""
