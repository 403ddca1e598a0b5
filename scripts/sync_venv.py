"""Uninstall what the lock no longer names, so that `make install` on an old venv leaves
exactly the lock (and mtplxd itself): pip installs the lock's pins but never removes a
package that left it, and a stale one would still be imported.

    .venv/bin/python scripts/sync_venv.py requirements.lock

Run by the venv's own interpreter: its installed distributions are the ones compared.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

KEEP = {"mtplxd"}  # the editable install of this project, not a locked dependency
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==")


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(lock_text: str) -> set[str]:
    """The names the lock pins (`name==version` at the start of a line)."""
    return {normalized(m.group(1)) for line in lock_text.splitlines() if (m := PIN.match(line))}


def stale(installed: set[str], lock_text: str) -> list[str]:
    """Installed distributions the lock does not pin, mtplxd aside."""
    keep = locked(lock_text) | KEEP
    return sorted(name for name in installed if normalized(name) not in keep)


def main(lock: str) -> int:
    installed = {d.metadata["Name"] for d in distributions() if d.metadata["Name"]}
    names = stale(installed, Path(lock).read_text())
    if not names:
        return 0
    print(f"removing what left {lock}: {' '.join(names)}")
    return subprocess.call([sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes", *names])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
