"""Our own kernels: only the glue no stock kernel covers (merging attention states)."""
