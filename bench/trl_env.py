"""A scratch venv with Hugging Face TRL for the side-by-side benchmark (bench/multilora.py), built once.

TRL is a benchmark-only dependency: it never enters the locked runtime (``requirements.lock``).
The venv lives under the ignored folder ``.bench/trl-venv`` of the checkout, is created without
pip or setuptools of its own, and sees the project venv's packages through a ``.pth`` file (a
fresh venv's old setuptools would hide the newer one torch needs); into it go only
``trl==1.16.0`` (``--no-deps``: its own pins would replace the locked transformers / torch) and
the three packages TRL imports that the lock lacks (``TRL_PACKAGES``). Known to work with the
locked transformers 5.19 / peft 0.21 / torch 2.13 CPU (requirements.lock).

Idempotent: a stamp file names what was installed; a venv whose stamp matches is reused as is.

    python bench/trl_env.py          # build (or reuse) it and print its python
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".bench" / "trl-venv"
TRL_PACKAGES = ("trl==1.16.0", "datasets==5.2.0", "multiprocess==0.70.19", "xxhash==4.1.0")
STAMP = "hourglass-bench-stamp.txt"


def stamp_text(project_site: str) -> str:
    """What a built venv records: the pins and the project site-packages it sees (a change rebuilds it)."""
    return "\n".join([*TRL_PACKAGES, f"project-site={project_site}"]) + "\n"


def site_packages(venv: Path) -> Path:
    """``<venv>/lib/pythonX.Y/site-packages`` for this interpreter's version."""
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def ensure(venv: Path = VENV, *, quiet: bool = True) -> Path:
    """The TRL venv's python, building the venv first when it is missing or stale.

    Raises:
        subprocess.CalledProcessError: the venv could not be created or pip failed (no registry).
    """
    project_site = sysconfig.get_paths()["purelib"]  # the project venv this runs in
    python = venv / "bin" / "python"
    stamp = venv / STAMP
    if python.exists() and stamp.exists() and stamp.read_text() == stamp_text(project_site):
        return python
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = site_packages(venv)
    # addsitedir (not a bare path line): the project venv's own .pth files are processed too
    (site / "hourglass-project.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-input"]
    subprocess.run([*pip, *(["-q"] if quiet else []), *TRL_PACKAGES], check=True)
    check = "import trl, datasets, transformers, peft, torch; print(trl.__version__)"
    subprocess.run([str(python), "-c", check], check=True, capture_output=quiet)
    stamp.write_text(stamp_text(project_site))
    return python


if __name__ == "__main__":
    print(ensure(quiet=False))
