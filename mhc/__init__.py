"""mhc: manifold-constrained hyper-connections (mHC) for PyTorch."""

from . import diagnostics
from .block import MHCBlock
from .hf import MHCConfig, MHCForCausalLM, convert_to_mhc
from .options import MHCOptions
from .projection import ConvergenceWarning, ProjectionInfo, birkhoff_project, birkhoff_project_reference, marginal_error
from .streams import StreamReduce, expand_streams, reduce_streams

__all__ = [
    "birkhoff_project",
    "birkhoff_project_reference",
    "marginal_error",
    "ProjectionInfo",
    "ConvergenceWarning",
    "MHCBlock",
    "MHCOptions",
    "expand_streams",
    "reduce_streams",
    "StreamReduce",
    "diagnostics",
    "MHCConfig",
    "MHCForCausalLM",
    "convert_to_mhc",
]
__version__ = "0.1.0"
