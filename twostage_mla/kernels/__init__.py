"""Our own kernels: only the glue no stock kernel covers (merging attention states, with the tiny query pass
fused into the final merge)."""
