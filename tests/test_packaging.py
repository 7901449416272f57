"""The wheel and the sdist ship what an installed ``mhc`` needs, and it finds it there.

Both are built from a copy of this source tree (tracked files plus untracked,
not ignored ones, as a commit of the working tree would hold), in this
environment, without build isolation (so no network): the wheel with
``pip wheel``, the sdist with ``python -m build``. Then:

* each holds every kernel source of ``mhc/csrc/`` byte for byte, and LICENSE;
* a wheel built from the unpacked sdist (what ``pip install <sdist>`` does) does too;
* the wheel installed into a fresh directory, imported from there, builds from
  its own ``mhc/csrc/`` (``mhc.cuda_build.source_dir()``), not from the repository;
* (slow) the wheel installed into a fresh venv trains a preset with its ``mhc-train`` console
  script from a folder outside the checkout, and ``mhc-diagnostics`` reads the model it wrote.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import mhc

pytestmark = pytest.mark.slow  # wheel and sdist builds

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = ROOT / "mhc" / "csrc"
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
DIST_NAME = "mhc-torch"
# The name setuptools gives the archives: the distribution name, normalised.
ARCHIVE_STEM = f"mhc_torch-{mhc.__version__}"


def _kernel_sources() -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(KERNEL_DIR.iterdir()) if p.suffix in KERNEL_SUFFIXES}
    # The two translation units the extension is built from must be among them.
    assert {"birkhoff.cu", "birkhoff_core.cuh", "birkhoff_kernels.cuh"} <= set(files), (
        f"kernel sources missing from {KERNEL_DIR}: {sorted(files)}"
    )
    return files


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _copy_source_tree(dest: Path) -> Path:
    """This checkout's files (tracked, plus untracked but not ignored) under ``dest``."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = _run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT
        ).stdout
        for rel in filter(None, listed.split("\0")):
            src = ROOT / rel
            if src.is_file():  # a tracked file deleted in the working tree is not part of it
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:  # an unpacked sdist: no git, nothing built in it yet
        shutil.copytree(
            ROOT,
            dest,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(".venv", "build", "dist", "*.egg-info", "__pycache__"),
        )
    return dest


@pytest.fixture(scope="module")
def build_env() -> dict:
    # Without isolation the build uses this environment's setuptools, which must be
    # what pyproject.toml's [build-system] asks for (the test extra installs it).
    major = int(metadata.version("setuptools").split(".")[0])
    assert major >= 77, f"setuptools {metadata.version('setuptools')} < 77: pip install -e '.[test]'"
    env = dict(os.environ)
    env.pop("MHC_CSRC_DIR", None)
    return env


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    return _copy_source_tree(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def wheel(source_tree, build_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source_tree),
        ],
        env=build_env,
    )
    wheels = list(out.glob("*.whl"))
    assert [w.name for w in wheels] == [f"{ARCHIVE_STEM}-py3-none-any.whl"], wheels
    return wheels[0]


@pytest.fixture(scope="module")
def sdist(source_tree, build_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    _run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), str(source_tree)],
        env=build_env,
    )
    sdists = list(out.glob("*.tar.gz"))
    assert [s.name for s in sdists] == [f"{ARCHIVE_STEM}.tar.gz"], sdists
    return sdists[0]


def _check_wheel(path: Path) -> None:
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        for name, data in _kernel_sources().items():
            member = f"mhc/csrc/{name}"
            assert member in names, f"{path.name} lacks {member}"
            assert zf.read(member) == data, f"{path.name}: {member} differs from the repository's"
        presets = sorted((ROOT / "mhc" / "train" / "presets").glob("*.yaml"))
        assert presets, "no training presets in mhc/train/presets/"
        for preset in presets:  # `mhc-train --config <name>` reads them from the installed package
            member = f"mhc/train/presets/{preset.name}"
            assert member in names and zf.read(member) == preset.read_bytes(), f"{path.name} lacks {member}"
        dist_info = f"{ARCHIVE_STEM}.dist-info"
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        for script in ("mhc-train = mhc.train.cli:train_main", "mhc-compare = mhc.train.cli:compare_main",
                       "mhc-diagnostics = mhc.diagnostics.__main__:main"):  # fmt: skip
            assert script in entry_points, entry_points
        assert zf.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        meta = email.parser.Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
        # Only the package goes into site-packages (the presets inside it): no tests/ or scripts/.
        assert {n.split("/")[0] for n in names} == {"mhc", dist_info}, sorted(names)
    assert meta["Name"] == DIST_NAME
    assert meta["Version"] == mhc.__version__
    assert meta["License-Expression"] == "Apache-2.0"


def test_wheel_ships_kernel_sources_and_license(wheel):
    _check_wheel(wheel)


def test_sdist_ships_kernel_sources_license_and_tests(sdist):
    with tarfile.open(sdist) as tf:
        names = set(tf.getnames())
        for name, data in _kernel_sources().items():
            member = f"{ARCHIVE_STEM}/mhc/csrc/{name}"
            assert member in names, f"{sdist.name} lacks {member}"
            assert tf.extractfile(member).read() == data, (
                f"{sdist.name}: {member} differs from the repository's"
            )
        assert tf.extractfile(f"{ARCHIVE_STEM}/LICENSE").read() == (ROOT / "LICENSE").read_bytes()
    # What the test suite reads, so that it runs from the unpacked sdist.
    for rel in ("pyproject.toml", "README.md", "tests/conftest.py", "tests/test_packaging.py"):
        assert f"{ARCHIVE_STEM}/{rel}" in names, f"{sdist.name} lacks {rel}"


def test_wheel_built_from_the_sdist_ships_kernel_sources(sdist, build_env, tmp_path):
    with tarfile.open(sdist) as tf:
        # The "data" filter refuses absolute paths and links out of the tree (Python >= 3.10.12).
        if hasattr(tarfile, "data_filter"):
            tf.extractall(tmp_path, filter="data")
        else:
            tf.extractall(tmp_path)
    out = tmp_path / "wheel"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(tmp_path / ARCHIVE_STEM),
        ],
        env=build_env,
    )
    (built,) = out.glob("*.whl")
    _check_wheel(built)


def test_installed_wheel_builds_from_its_own_kernel_sources(wheel, build_env, tmp_path):
    target = tmp_path / "site"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        env=build_env,
    )
    # PYTHONPATH comes before site-packages (and before an editable install's
    # finder), so this imports the installed copy; cwd is not the repository.
    env = dict(build_env, PYTHONPATH=str(target))
    # One interpreter (importing mhc takes seconds): the public lookups, then the CLI's listing.
    probe = (
        "import json, mhc, mhc.cuda_build as cb; "
        "print(json.dumps({'mhc': mhc.__file__, 'dir': str(cb.source_dir()), "
        "'files': [p.name for p in cb.source_files()]})); "
        "raise SystemExit(cb.main(['--sources']))"
    )
    first, *listing = _run([sys.executable, "-c", probe], cwd=tmp_path, env=env).stdout.strip().splitlines()
    found = json.loads(first)
    installed = (target / "mhc").resolve()
    assert Path(found["mhc"]).resolve().parent == installed, found
    assert Path(found["dir"]).resolve() == installed / "csrc", found
    assert found["files"] == sorted(_kernel_sources()), found
    for name, data in _kernel_sources().items():
        assert (installed / "csrc" / name).read_bytes() == data
    # `python -m mhc.cuda_build --sources` names the same directory and files (exit 0 checked by _run).
    assert listing[0] == f"kernel source directory: {found['dir']}", listing
    assert [line.strip() for line in listing[1:-1]] == found["files"], listing


def _fresh_venv(root: Path, build_env: dict) -> tuple[Path, Path]:
    """A new virtual environment that sees this environment's packages (torch, transformers, ...) but not mhc.

    ``venv --system-site-packages`` would expose the *base* interpreter's packages when this one is itself a
    venv, so a ``.pth`` file lists this environment's site-packages folders instead. A plain path line in a
    ``.pth`` file adds the folder without running the ``.pth`` files inside it, so an editable install of
    mhc there (its import hook) stays out. Returns ``(python, bin folder)``.
    """
    import sysconfig
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(root)
    bin_dir = root / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / ("python.exe" if os.name == "nt" else "python")
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=build_env
    ).stdout.strip()
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (Path(purelib) / "outer_environment.pth").write_text("".join(p + "\n" for p in ours))
    return python, bin_dir


@pytest.mark.slow
def test_installed_wheel_trains_from_its_presets_with_its_console_scripts(wheel, build_env, tmp_path):
    """`pip install` the wheel into a fresh venv; from a folder outside the checkout, `mhc-train` trains a preset."""
    python, bin_dir = _fresh_venv(tmp_path / "venv", build_env)
    env = {k: v for k, v in build_env.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]))
    # This environment's pip installs into the new one (--python); no index, no dependencies (they are visible).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        env=env,
    )
    work = tmp_path / "work"  # not the checkout: nothing of it is importable from here
    work.mkdir()
    probe = "import mhc, mhc.train as T; print(mhc.__file__); print(T.preset_path('tiny_cpu_mhc'))"
    mhc_file, preset = _run([str(python), "-c", probe], cwd=work, env=env).stdout.split()
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env
        ).stdout.strip()
    )
    assert Path(mhc_file).resolve() == (site / "mhc" / "__init__.py").resolve(), (
        mhc_file
    )  # the installed copy
    assert Path(preset).resolve().parent == (site / "mhc" / "train" / "presets").resolve(), preset
    for name in ("mhc-train", "mhc-compare", "mhc-diagnostics"):
        assert (bin_dir / name).is_file() or (bin_dir / f"{name}.exe").is_file(), f"no console script {name}"
    tiny = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--intermediate-size", "64", "--seq-len", "32",
            "--batch-size", "4", "--max-corpus-mb", "0.2", "--max-steps", "3", "--eval-interval", "0",
            "--eval-batches", "1", "--ckpt-interval", "0", "--progress", "false", "--plots", "false"]  # fmt: skip
    proc = _run([str(bin_dir / "mhc-train"), "--config", "tiny_cpu_mhc", "--run-dir", "run", "--cache-dir", str(tmp_path / "cache"), *tiny],
                cwd=work, env=env)  # fmt: skip
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["variant"] == "mhc", summary
    assert (work / "run" / "model" / "config.json").is_file(), proc.stdout[-2000:]
    # The stability report of the model it wrote, through the third console script.
    report = _run(
        [str(bin_dir / "mhc-diagnostics"), "run", "--no-backward", "--out", str(tmp_path / "stability.png")],
        cwd=work,
        env=env,
    )
    assert "run/model: MHCForCausalLM, 4 sites" in report.stdout, report.stdout[-2000:]
    assert "usage: mhc-compare" in _run([str(bin_dir / "mhc-compare"), "--help"], cwd=work, env=env).stdout
