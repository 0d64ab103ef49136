"""Pattern library: one module per fusible family."""
