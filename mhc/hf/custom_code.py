"""The loader a saved mHC model carries, so that transformers' Auto classes load it without ``import mhc``.

:meth:`mhc.MHCForCausalLM.save_pretrained` writes, beside the weights, a small module
:data:`CODE_FILE` (``modeling_mhc.py``) and, in ``config.json``, transformers'
custom-code hook :data:`AUTO_MAP`::

    "auto_map": {"AutoConfig": "modeling_mhc.MHCConfig",
                 "AutoModelForCausalLM": "modeling_mhc.MHCForCausalLM"}

so that, in any process where ``mhc-torch`` is installed,
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it.
The module defines nothing: it imports :class:`mhc.MHCConfig` and
:class:`mhc.MHCForCausalLM` from the installed package, so the loaded objects are
``mhc``'s own classes (``isinstance``, pickling and every method as after ``import mhc``).
Nothing else from the folder is run; transformers copies the module into its
``HF_MODULES_CACHE`` and imports it from there.

How transformers uses the hook:

* Without ``import mhc``, ``model_type="mhc"`` is unknown to transformers, so it takes the
  hook, which needs ``trust_remote_code=True`` (without it transformers refuses with an
  error asking for it, and runs nothing). Importing the module imports ``mhc``, which
  registers ``model_type="mhc"`` with the Auto classes.
* After ``import mhc`` the plain call works as before: transformers >= 5 prefers a
  registered model type that is not its own over the hook, whatever ``trust_remote_code``
  says; transformers 4.57 takes the hook when ``trust_remote_code=True``, and the module
  gives the same classes.
* ``transformers.dynamic_module_utils.check_imports`` asks for every package a custom module
  imports outside a ``try`` block, and would say ``pip install mhc`` (another project's
  name on PyPI). The module's import sits in a ``try`` and, without ``mhc`` installed,
  raises an ``ImportError`` that says to install mhc-torch from its repository (:data:`INSTALL`):
  it is not on PyPI, so a ``pip install`` of a name would fetch whatever claims that name.

:meth:`MHCConfig.register_for_auto_class` and :meth:`MHCForCausalLM.register_for_auto_class`
are no-ops: transformers calls them on classes it loads through a hook, and a
registered class would have its defining source files (``mhc/hf/config.py`` ...)
copied into every folder it is saved to, in place of this module.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["AUTO_MAP", "CODE_FILE", "INSTALL", "code_source", "write_code_file"]

CODE_FILE = "modeling_mhc.py"
# How a machine without mhc gets it: from the repository, since mhc-torch is not on PyPI (README, "Install").
INSTALL = "`pip install git+https://github.com/mhc-torch/mhc.git`"
AUTO_MAP = {
    "AutoConfig": "modeling_mhc.MHCConfig",
    "AutoModelForCausalLM": "modeling_mhc.MHCForCausalLM",
}

_SOURCE = '''"""An mHC model (manifold-constrained hyper-connections): the classes come from the mhc-torch package.

Written by mhc-torch {version} (MHCForCausalLM.save_pretrained). config.json's "auto_map" points here, so
that transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) loads the model
wherever mhc-torch is installed ({install}). This file defines nothing of its own: it
imports mhc's classes. After `import mhc` the folder also loads without trust_remote_code.
"""

try:
    from mhc.hf import MHCConfig, MHCForCausalLM
except ModuleNotFoundError as err:
    if err.name != "mhc" and not (err.name or "").startswith("mhc."):
        raise  # mhc is there, something it needs is not: that error says what
    raise ImportError(
        "This model is an mHC model (config.json model_type 'mhc'); loading it needs the mhc-torch package, "
        "which is not installed here ({{}}). Install it from its repository: {install} (it is not on PyPI, "
        "and `pip install mhc` installs an unrelated project).".format(err)
    ) from err

__all__ = ["MHCConfig", "MHCForCausalLM"]
'''


def code_source() -> str:
    """The text of :data:`CODE_FILE` (it names the installed ``mhc`` version that wrote it)."""
    from .. import __version__

    return _SOURCE.format(version=__version__, install=INSTALL)


def write_code_file(directory: str | os.PathLike) -> Path:
    """Write :data:`CODE_FILE` into ``directory``; returns its path.

    Written to a temporary name and renamed, so a reader (or a process killed meanwhile)
    never sees a partial file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CODE_FILE
    tmp = directory / f".{CODE_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(code_source(), encoding="utf-8")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
