"""`make install` syncs an old venv to the lock: scripts/sync_venv.py uninstalls what the
lock no longer pins (pip alone only installs). End to end on a fresh venv, whose bundled
setuptools plays a package that left the lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "sync_venv.py"
sys.path.insert(0, str(SCRIPT.parent))
from sync_venv import locked, stale  # noqa: E402

LOCK = """# header comment
anyio==4.16.0 \\
    --hash=sha256:aa
    # via mtplxd (pyproject.toml)
Jinja2==3.1.6 \\
    --hash=sha256:bb
mlx-lm==0.31.0 ; sys_platform == 'darwin' \\
    --hash=sha256:cc
"""


def test_the_lock_names_are_read_and_compared_as_pep_503_names():
    assert locked(LOCK) == {"anyio", "jinja2", "mlx-lm"}
    installed = {"anyio", "jinja2", "mlx_lm", "mtplxd", "left-the-lock", "Old.Package"}
    assert stale(installed, LOCK) == ["Old.Package", "left-the-lock"]


def _installed(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-c", "from importlib.metadata import distributions as d; "
                          "print('\\n'.join(x.metadata['Name'] for x in d()))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return set(out.split())


def test_a_package_that_left_the_lock_is_uninstalled(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    before = _installed(python)
    if "setuptools" not in before:
        pytest.skip("this Python's venv comes without setuptools: nothing to play the stale package")
    lock = tmp_path / "requirements.lock"
    lock.write_text("".join(f"{name}==0 \\\n    --hash=sha256:00\n" for name in before if name != "setuptools"))
    run = subprocess.run([str(python), str(SCRIPT), str(lock)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "setuptools" in run.stdout
    assert _installed(python) == before - {"setuptools"}
    again = subprocess.run([str(python), str(SCRIPT), str(lock)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout == ""  # in sync: nothing to do
