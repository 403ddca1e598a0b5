"""Training corpus: Python source files from a folder.

The default folder is the running interpreter's standard library. Test
suites, installed packages and a fixed list of held-out modules are skipped;
the held-out modules stay unseen so acceptance and loss can be measured on
code the model never trained on (`held_out_files`).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Well-known pure-Python stdlib modules kept out of training (top-level name:
# a module file or a package folder).
HELD_OUT_MODULES: tuple[str, ...] = (
    "bisect", "calendar", "colorsys", "dataclasses", "difflib", "fnmatch", "fractions",
    "glob", "graphlib", "heapq", "ipaddress", "json", "shlex", "statistics", "textwrap",
)
SKIPPED_PARTS = frozenset({
    "test", "tests", "idle_test", "unittest_tests", "site-packages", "dist-packages",
    "__pycache__", ".git", ".venv", "venv", "node_modules",
})


@dataclass(frozen=True)
class Document:
    path: str  # relative to the corpus folder, '/'-separated
    text: str


def default_corpus_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _order_key(relative: str) -> str:
    # A fixed pseudo-random order: a size cap samples the whole tree rather
    # than the first folders alphabetically.
    return hashlib.sha1(relative.encode()).hexdigest()


def _candidates(folder: Path) -> list[tuple[str, Path]]:
    found = []
    for path in folder.rglob("*.py"):
        relative = path.relative_to(folder)
        parts = relative.parts
        if any(p in SKIPPED_PARTS for p in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        found.append((relative.as_posix(), path))
    return sorted(found, key=lambda item: (_order_key(item[0]), item[0]))


def _is_held_out(relative: str, held_out: tuple[str, ...]) -> bool:
    top = relative.split("/", 1)[0]
    return top.removesuffix(".py") in held_out


def _read(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def load_corpus(
    folder: str | Path | None = None,
    max_bytes: int | None = None,
    held_out: tuple[str, ...] = HELD_OUT_MODULES,
) -> list[Document]:
    """The training documents of `folder`, in a deterministic order.

    `max_bytes` caps the total size (whole files, in that order).
    """
    root = Path(folder) if folder else default_corpus_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus folder not found: {root}")
    docs: list[Document] = []
    total = 0
    for relative, path in _candidates(root):
        if _is_held_out(relative, held_out):
            continue
        text = _read(path)
        if text is None:
            continue
        size = len(text.encode())
        if max_bytes is not None and docs and total + size > max_bytes:
            continue  # smaller files later in the order may still fit
        docs.append(Document(relative, text))
        total += size
    if not docs:
        raise ValueError(f"no usable *.py files under {root}")
    return docs


def held_out_files(folder: str | Path | None = None, held_out: tuple[str, ...] = HELD_OUT_MODULES) -> list[Document]:
    """The held-out modules' source files (for evaluation), deterministic order."""
    root = Path(folder) if folder else default_corpus_dir()
    docs = []
    for relative, path in sorted(_candidates(root), key=lambda item: item[0]):
        if _is_held_out(relative, held_out):
            text = _read(path)
            if text is not None:
                docs.append(Document(relative, text))
    return docs


def manifest(docs: list[Document]) -> dict:
    """What the corpus was: file count, bytes and one digest over paths and contents."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.path.encode() + b"\0" + doc.text.encode() + b"\0")
    return {
        "files": len(docs),
        "bytes": sum(len(d.text.encode()) for d in docs),
        "sha256": digest.hexdigest(),
    }
