"""mhc: manifold-constrained hyper-connections (mHC) for PyTorch.

The core (:class:`MHCBlock`, :func:`birkhoff_project`, the stream helpers and
:mod:`mhc.diagnostics`) needs only torch. The HuggingFace names
(:class:`MHCConfig`, :class:`MHCForCausalLM`, :func:`convert_to_mhc`) live in
:mod:`mhc.hf` and import transformers the first time one is used. Saved mHC
models still load through transformers' Auto classes after ``import mhc``:
``model_type="mhc"`` is registered as soon as transformers is imported, in
whichever order the two are imported.
"""

import importlib.abc
import importlib.util
import sys
import warnings

from . import diagnostics
from .block import MHCBlock
from .options import MHCOptions
from .projection import (
    ConvergenceWarning,
    ProjectionInfo,
    birkhoff_project,
    birkhoff_project_reference,
    marginal_error,
)
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

_HF_NAMES = ("MHCConfig", "MHCForCausalLM", "convert_to_mhc")


def __getattr__(name: str):
    if name in _HF_NAMES:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'mhc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_HF_NAMES})


def _register_with_transformers() -> None:
    """Import :mod:`mhc.hf`, which registers ``model_type="mhc"`` with transformers' Auto classes."""
    try:
        from . import hf  # noqa: F401
    except Exception as err:  # a transformers mhc does not support must not break `import transformers`
        warnings.warn(
            f"mhc: could not register model_type 'mhc' with transformers ({type(err).__name__}: {err}); "
            "saved mHC models will not load through the Auto classes",
            RuntimeWarning,
            stacklevel=2,
        )


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_with_transformers` right after ``transformers`` is first imported.

    Python has no post-import hook, so this finder answers for ``transformers``
    once: it takes the spec the other finders give and wraps its loader so that
    the registration follows the module's own execution. It then removes itself.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                _register_with_transformers()

            def __getattr__(self, attr):  # get_resource_reader, get_filename, ...: the real loader's
                return getattr(loader, attr)

        spec.loader = _Loader()
        return spec


if "transformers" in sys.modules:
    _register_with_transformers()
elif not any(isinstance(finder, _AfterTransformersImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterTransformersImport())
