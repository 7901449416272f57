"""mhc: manifold-constrained hyper-connections (mHC) for PyTorch."""

from .projection import ConvergenceWarning, ProjectionInfo, birkhoff_project, marginal_error

__all__ = ["birkhoff_project", "marginal_error", "ProjectionInfo", "ConvergenceWarning"]
__version__ = "0.1.0"
