"""`mtplxd pull` through the real huggingface_hub client, against a local stand-in
for the Hub (tests/fake_hub.py) and then offline from the cache it filled.

Each pull runs in a subprocess: huggingface_hub reads HF_ENDPOINT, HF_HOME and
HF_HUB_OFFLINE when it is imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.backends.descriptors import inspect_checkpoint
from engine.checkpoint import read_header
from mtplxd.store.models import read_record
from tests.checkpoints import write
from tests.fake_hub import COMMIT, FakeHub

ASSETS = Path(__file__).resolve().parent.parent / "engine" / "assets"
REPO = "org/tiny-mtp"


def _with_index(folder: Path) -> Path:
    """Give a one-file checkpoint the index real repositories carry (pull reads it first)."""
    weight_map = {key: "model.safetensors" for key in read_header(folder / "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture
def embedded_repo(tmp_path) -> Path:
    """The embedded model as one float32 weights file, trunk and heads (19 MB: it spans
    more than one of the client's 10 MB download chunks, so a connection dropped near its
    end is resumed mid-file with a Range)."""
    import engine  # noqa: F401  (BLAS before mlx)
    import mlx.core as mx

    repo = Path(shutil.copytree(ASSETS, tmp_path / "repo"))
    weights = {}
    for path in sorted(repo.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
        path.unlink()
    mx.save_safetensors(str(repo / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()},
                        metadata={"format": "pt"})
    return _with_index(repo)


def pull(tmp_path: Path, *args: str, hub: FakeHub | None = None, offline: bool = False,
         free_bytes: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "MTPLXD_HOME": str(tmp_path / "state"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1", "HF_TOKEN": ""}
    env.pop("HF_HUB_OFFLINE", None)
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    # A full disk, simulated in the child: the free-space check is the only thing patched.
    patch = f"import engine.conversion as c; c.free_bytes = lambda path: {free_bytes}; " if free_bytes else ""
    code = f"import sys; {patch}from mtplxd.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "pull", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def one_line_error(result: subprocess.CompletedProcess, after_progress: bool = False) -> str:
    """The error line; alone on stderr unless the download had started (progress bars)."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and lines[-1].startswith("mtplxd pull: "), result.stderr
    assert after_progress or len(lines) == 1, result.stderr
    return lines[-1]


def test_interrupted_pull_resumes_then_works_offline(tmp_path, embedded_repo):
    with FakeHub({REPO: embedded_repo}) as hub:
        # 1. The weights cannot be fetched: one line; the small files stay in the cache.
        hub.fail.add("model.safetensors")
        err = one_line_error(pull(tmp_path, REPO, "--quantize", "8", hub=hub), after_progress=True)
        assert "HTTP 500" in err
        assert len(hub.gets("config.json")) == 1

        # 2. Again: the connection drops half-way through the weights; the client resumes
        # from the last byte it wrote, and nothing already cached is fetched twice.
        hub.fail.clear()
        hub.drop_once.add("model.safetensors")
        result = pull(tmp_path, REPO, "--quantize", "8", hub=hub)
        assert result.returncode == 0, result.stderr
        weight_gets = hub.gets("model.safetensors")
        assert weight_gets[-1] is not None and weight_gets[-1].startswith("bytes="), weight_gets
        assert int(weight_gets[-1][len("bytes="):-1]) > 0
        assert len(hub.gets("config.json")) == 1 and len(hub.gets("tokenizer.json")) == 1
        served = len(hub.requests)

    model = tmp_path / "state" / "models" / "tiny-mtp-8bit"
    assert "mtplxd start --model tiny-mtp-8bit" in result.stdout
    record = read_record(model)
    assert (record["source"], record["revision"], record["mtp_heads"]) == (REPO, COMMIT, 2)
    assert record["quantization"] == {"bits": 8, "group_size": 64}
    report = inspect_checkpoint(model)
    assert (report.status, report.mtp_heads) == ("supported", 2)

    # 3. Offline, the Hub gone: the cache serves the same snapshot.
    result = pull(tmp_path, REPO, "--name", "offline-4bit", offline=True)
    assert result.returncode == 0, result.stderr
    assert inspect_checkpoint(tmp_path / "state" / "models" / "offline-4bit").status == "supported"
    assert len(hub.requests) == served

    # 4. Pulling what is already there is a no-op.
    again = pull(tmp_path, REPO, "--quantize", "8", offline=True)
    assert again.returncode == 0 and "already pulled" in again.stdout


def test_pull_refuses_before_downloading(tmp_path, embedded_repo):
    headless = _with_index(write("mimo", tmp_path / "headless", mtp_heads=0))
    with FakeHub({REPO: embedded_repo, "org/headless": headless}) as hub:
        err = one_line_error(pull(tmp_path, "org/headless", hub=hub))
        assert "no MTP head" in err and "mtplxd train --heads-only" in err

        err = one_line_error(pull(tmp_path, REPO, hub=hub, free_bytes=1000))
        assert "not enough disk space" in err

        err = one_line_error(pull(tmp_path, "org/missing", hub=hub))
        assert "no such repository" in err
        err = one_line_error(pull(tmp_path, REPO, "--revision", "v9", hub=hub))
        assert "no revision 'v9'" in err
        assert hub.gets("model.safetensors") == []  # no weights were fetched for any of them
    assert not (tmp_path / "state" / "models").exists() or not any((tmp_path / "state" / "models").iterdir())


def test_pull_offline_unknown_repository(tmp_path):
    err = one_line_error(pull(tmp_path, "org/never-pulled", offline=True))
    assert "not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err
