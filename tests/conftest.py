import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so
# CI checks them too. Set before any kernel module is imported (and inherited
# by the worker processes the distributed tests spawn).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread: with two, torch 2.13's CPU float32 exp was now and then
    # ~1e-4 off in the worker thread's share of a tensor (about 1 process in 20 on
    # the CI machine; never with one thread in 90 runs), which fails 1e-5 checks.
    # The tensors here are small, so nothing is lost.
    torch.set_num_threads(1)
