import importlib.util
import os
import random
import secrets
from pathlib import Path

import mutations
import numpy as np
import pytest
import torch

# Without CUDA, the fused Triton kernels run in Triton's interpreter on CPU
# tensors, so their maths is tested on every machine. This must be set before
# mhc (and so mhc.fused.kernels) is imported. It is forced, not defaulted:
# without CUDA the interpreter is the only way Triton runs at all.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ["TRITON_INTERPRET"] = "1"

SEED_VARIABLE = "MHC_TEST_SEED"


def pytest_configure(config):
    # MHC_MUTATION=<name> (tests/mutation_probe.py) applies one deliberate bug
    # here, before any test module imports mhc.
    try:
        mutations.activate_from_environment()
    except ValueError as err:  # an unknown name
        raise pytest.UsageError(str(err)) from None


def pytest_report_header(config):
    active = mutations.active()
    return f"mutation under test: {active} (MHC_MUTATION)" if active else None


@pytest.fixture
def fresh_seed(request) -> int:
    """A fresh random seed, with torch, numpy and ``random`` seeded by it.

    ``MHC_TEST_SEED=<n>`` forces the seed, to re-run a failure. A failing test
    that used this fixture shows ``seed=<n>`` in its report (a "seed" section).
    """
    forced = os.environ.get(SEED_VARIABLE)
    seed = int(forced) if forced else secrets.randbelow(2**31)
    torch.manual_seed(seed)  # every device's generator
    np.random.seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("seed", f"seed={value} (re-run with {SEED_VARIABLE}={value})"))


@pytest.fixture(scope="session")
def cli():
    """``scripts/train_lm.py`` loaded as a module: ``cli.main(argv)`` is the command line, run in-process."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm_cli", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The training tests' tiny run, trained once per module (tests/training_support.py)."""
    from training_support import train_full_run  # imports mhc: only once a test asks (see pytest_configure)

    return train_full_run(tmp_path_factory)
