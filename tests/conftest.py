import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so
# CI checks them too. Set before any kernel module is imported (and inherited
# by the worker processes the distributed tests spawn).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
