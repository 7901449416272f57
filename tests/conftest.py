import importlib.util
import os

import torch

# Without CUDA, the fused Triton kernels run in Triton's interpreter on CPU
# tensors, so their maths is tested on every machine. This must be set before
# mhc (and so mhc.fused_kernels) is imported.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
