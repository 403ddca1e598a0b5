"""`mtplxd inspect`: the compatibility registry through its Python API and the real CLI."""

from __future__ import annotations

import importlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine.backends.descriptors import DESCRIPTORS, PLAIN_BACKEND, inspect_checkpoint
from engine.checkpoint import CheckpointError
from tests.checkpoints import FAMILIES, write
from tests.checkpoints.layouts import MTP_FAMILIES, write_layout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "mtplxd"


def cli(*args: str, module: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mtplxd"] if module else [str(SCRIPT)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


# --- every MTP family, header-level layouts -------------------------------------------

@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_family_recognised(tmp_path, family, heads):
    report = inspect_checkpoint(write_layout(family, tmp_path, mtp_heads=heads))
    assert (report.family, report.status, report.mtp_heads) == (family, "supported", heads)
    assert report.depth_max >= max(heads, 2)
    assert report.descriptor.backend_module == f"engine.backends.{family}"
    assert len(report.head_keys_found) >= heads


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_head_in_sidecar_and_sharded_checkpoint(tmp_path, family):
    sidecar = inspect_checkpoint(write_layout(family, tmp_path / "a", sidecar=True))
    sharded = inspect_checkpoint(write_layout(family, tmp_path / "b", mtp_heads=2, shards=3))
    both = inspect_checkpoint(write_layout(family, tmp_path / "c", shards=2, sidecar=True))
    assert (tmp_path / "a" / "mtp.safetensors").is_file()
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    assert [r.mtp_heads for r in (sidecar, sharded, both)] == [1, 2, 1]
    assert {r.status for r in (sidecar, sharded, both)} == {"supported"}


@pytest.mark.parametrize("root", ["mtp.", "model.language_model.mtp.", "language_model.mtp."])
def test_qwen3_5_head_roots(tmp_path, root):
    report = inspect_checkpoint(write_layout("qwen3_5", tmp_path, mtp_root=root))
    assert (report.status, report.mtp_heads) == ("supported", 1)
    assert any(k.startswith(root) for k in report.head_keys_found)


def test_qwen3_next_without_count_field(tmp_path):
    # The released Qwen3-Next config.json names no MTP count: the weights decide.
    report = inspect_checkpoint(write_layout("qwen3_next", tmp_path, config_heads=None))
    assert (report.status, report.mtp_heads) == ("supported", 1)


def test_weights_decide_over_config_count(tmp_path):
    report = inspect_checkpoint(write_layout("mimo", tmp_path, mtp_heads=2, config_heads=1))
    assert (report.status, report.mtp_heads) == ("supported", 2)
    assert "num_nextn_predict_layers=1" in report.reason


def test_descriptors():
    # every family mtplxd runs has a tiny-checkpoint writer; those it cannot run yet say why
    assert {f for f, d in DESCRIPTORS.items() if not d.unsupported} == set(FAMILIES)
    for d in DESCRIPTORS.values():
        assert d.family in d.model_types and d.head_count_fields and d.head_key_patterns
        assert all("{i}" in p or "{n+i}" in p for p in d.head_key_patterns)
        assert 1 <= d.depth_range[0] <= d.depth_range[1]
        assert d.norm_shift == (d.family.startswith("qwen") or d.family == "step3p5")  # zero-centred norms
        assert 0 < d.sampler_defaults.temperature and 0 < d.sampler_defaults.top_p <= 1
    assert DESCRIPTORS["qwen3_5"].model_types == ("qwen3_5", "qwen3_5_text")
    assert DESCRIPTORS["qwen3_5_moe"].model_types == ("qwen3_5_moe", "qwen3_5_moe_text")


def test_inspect_imports_no_mlx_and_no_backend(tmp_path):
    folder = write_layout("deepseek_v3", tmp_path)
    code = (
        "import sys; from engine.backends.descriptors import inspect_checkpoint as i; "
        f"i({str(folder)!r}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm') "
        "or m.startswith('engine.backends.') and m != 'engine.backends.descriptors'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr


# --- the real family writers (tests/checkpoints/<family>.py), once they exist ----------

def real_writer(family: str):
    try:
        return importlib.import_module(f"tests.checkpoints.{FAMILIES[family]}")
    except ModuleNotFoundError as e:
        if e.name != f"tests.checkpoints.{FAMILIES[family]}":
            raise
        pytest.skip(f"tests/checkpoints/{FAMILIES[family]}.py not written yet")


@pytest.mark.parametrize("sidecar", [False, True])
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_checkpoint_writers(tmp_path, family, heads, sidecar):
    real_writer(family)
    try:
        folder = write(family, tmp_path / family, mtp_heads=heads, sidecar=sidecar)
    except (ValueError, NotImplementedError) as e:
        pytest.skip(f"{family} writer does not offer {heads} head(s): {e}")
    report = inspect_checkpoint(folder or tmp_path / family)
    assert (report.family, report.status, report.mtp_heads) == (family, "supported", heads), report.reason


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_real_checkpoint_with_its_heads_removed(tmp_path, family):
    """The writer's checkpoint with every MTP tensor taken out (the config still says
    what it said): AR only, and the reason names where the heads were looked for."""
    from safetensors.numpy import load_file, save_file

    from engine.backends.descriptors import head_key_predicate
    from engine.checkpoint import read_config, text_config

    real_writer(family)
    folder = write(family, tmp_path / family, mtp_heads=2)
    before = inspect_checkpoint(folder)
    is_head = head_key_predicate(before.descriptor, text_config(read_config(folder))["num_hidden_layers"])
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    kept = {k: v for k, v in tensors.items() if not is_head(k)}
    assert len(kept) < len(tensors)
    save_file(kept, str(path), metadata={"format": "pt"})
    report = inspect_checkpoint(folder)
    assert (report.family, report.status, report.mtp_heads, report.depth_max) == (family, "ar-only", 0, 0)
    assert "no MTP head weights found" in report.reason
    # mlx-lm runs it AR-only, or the family's own backend where mlx-lm has no model for it
    own = before.descriptor.own_trunk
    assert report.descriptor.backend_module == (before.descriptor.backend_module if own else PLAIN_BACKEND)


# --- no head, partial head, unknown model -----------------------------------------------

@pytest.mark.parametrize("family, looked_for", [
    ("mimo", "model.mtp_layers.{i}."),
    ("deepseek_v3", "model.layers.{2+i}."),
    ("glm4_moe", "model.layers.{2+i}."),
    ("qwen3_next", "mtp."),
    ("qwen3_5", "model.language_model.mtp."),
    ("qwen3_5_moe", "language_model.mtp."),
    ("step3p5", "model.layers.{2+i}."),
    ("glm_moe_dsa", "model.layers.{2+i}."),
    ("nemotron_h", "mtp.layers.{i}."),
    ("hy_v3", "model.layers.{2+i}."),
    ("deepseek_v4", "mtp.{i}."),
])
def test_config_names_heads_weights_lack_them(tmp_path, family, looked_for):
    report = inspect_checkpoint(write_layout(family, tmp_path, mtp_heads=0, config_heads=1))
    assert (report.family, report.status, report.mtp_heads, report.depth_max) == (family, "ar-only", 0, 0)
    assert looked_for in report.reason and "=1" in report.reason
    own = DESCRIPTORS[family].own_trunk  # no mlx-lm model: its own backend runs it AR-only
    assert report.descriptor.backend_module == (DESCRIPTORS[family].backend_module if own else PLAIN_BACKEND)


@pytest.mark.parametrize("family, drop, missing", [
    ("mimo", ("input_proj",), "model.mtp_layers.0.input_proj.weight"),
    ("deepseek_v3", ("layers.2.eh_proj", "layers.2.hnorm"), "model.layers.2.eh_proj.weight"),
    ("glm4_moe", ("layers.2.mlp.",), "model.layers.2.mlp."),
    ("qwen3_next", ("mtp.fc.",), "mtp.fc.weight"),
    ("qwen3_5", ("mtp.layers.",), "mtp.layers.{i}."),
    ("qwen3_5_moe", ("mtp.layers.1.self_attn",), "mtp.layers.1.self_attn."),
    ("mimo", ("mtp_layers.0.",), "MTP head 0 is missing"),
    ("mimo_v2_flash", ("mtp.layers.1.pre_mlp_layernorm",), "model.mtp.layers.1.pre_mlp_layernorm.weight"),
    ("mimo_v2_flash", ("mtp.layers.0.",), "MTP head 0 is missing"),
    ("step3p5", ("layers.3.transformer.shared_head.norm",), "model.layers.3.transformer.shared_head.norm.weight"),
    ("glm_moe_dsa", ("layers.2.self_attn.",), "model.layers.2.self_attn."),
    # Nemotron-H: a head is two layers, the fusion on the first, the final norm on the last
    ("nemotron_h", ("mtp.layers.2.eh_proj",), "mtp.layers.2.eh_proj.weight"),
    ("nemotron_h", ("mtp.layers.1.final_layernorm",), "mtp.layers.1.final_layernorm.weight"),
    ("nemotron_h", ("mtp.layers.3.mixer.",), "mtp.layers.3.mixer."),
    ("nemotron_h", ("mtp.layers.3.",), "3 MTP layer(s) at mtp.layers.{i}.* do not make whole heads of 2 blocks"),
    ("nemotron_h", ("mtp.layers.1.",), "MTP layer 1 is missing"),
    ("hy_v3", ("layers.3.final_layernorm",), "model.layers.3.final_layernorm.weight"),
    ("deepseek_v4", ("mtp.1.h_proj",), "mtp.1.h_proj.weight"),
    ("deepseek_v4", ("mtp.0.hc_ffn_",), "mtp.0.hc_ffn_fn"),
    ("deepseek_v4", ("mtp.0.",), "MTP head 0 is missing"),
])
def test_partial_head_is_unsupported(tmp_path, family, drop, missing):
    folder = write_layout(family, tmp_path, mtp_heads=2, drop=drop)
    report = inspect_checkpoint(folder)
    assert (report.family, report.status, report.depth_max) == (family, "unsupported", 0)
    assert missing in report.reason and report.descriptor is None


def test_mimo_v2_flash_without_heads_is_ar_only(tmp_path):
    # Its released config.json names no MTP count: without the weights, nothing to go by.
    report = inspect_checkpoint(write_layout("mimo_v2_flash", tmp_path, mtp_heads=0))
    assert (report.family, report.status, report.mtp_heads, report.depth_max) == ("mimo_v2_flash", "ar-only", 0, 0)
    assert "model.mtp.layers.{i}." in report.reason and report.descriptor.backend_module == PLAIN_BACKEND


@pytest.mark.parametrize("family", ["mimo_v2_flash", "step3p5", "glm_moe_dsa", "nemotron_h"])
def test_heads_without_a_buildable_trunk_are_unsupported(tmp_path, family, monkeypatch):
    """An mlx-lm too old to build the trunk: the heads are there, but nothing would run
    them; the report says so rather than promising MTP (or silently running AR)."""
    import engine.backends.descriptors as descriptors

    folder = write_layout(family, tmp_path, mtp_heads=2)
    assert inspect_checkpoint(folder).status == "supported"
    monkeypatch.setattr(descriptors, "mlx_lm_can_build", lambda model_type: model_type != family)
    report = inspect_checkpoint(folder)
    assert (report.family, report.status, report.depth_max, report.descriptor) == (family, "unsupported", 0, None)
    assert f"no mlx_lm.models.{family}" in report.reason and "2 MTP head(s)" in report.reason


@pytest.mark.parametrize("family", [f for f, d in DESCRIPTORS.items() if d.own_trunk and not d.unsupported])
def test_own_trunk_needs_no_mlx_lm_model(tmp_path, family, monkeypatch):
    """A family whose trunk its backend writes (mlx-lm has no model for it) is supported
    whatever mlx-lm can build, and without heads its own backend runs it AR-only."""
    import engine.backends.descriptors as descriptors

    assert not descriptors.mlx_lm_can_build(family)
    monkeypatch.setattr(descriptors, "mlx_lm_can_build", lambda model_type: False)
    report = inspect_checkpoint(write_layout(family, tmp_path / "a", mtp_heads=2))
    assert (report.status, report.mtp_heads, report.descriptor.backend_module) == (
        "supported", 2, f"engine.backends.{family}")
    bare = inspect_checkpoint(write_layout(family, tmp_path / "b", mtp_heads=0))
    assert (bare.status, bare.depth_max, bare.descriptor.backend_module) == (
        "ar-only", 0, f"engine.backends.{family}")


@pytest.mark.parametrize("blocks, status, said", [
    (["attention", "moe"], "supported", "2 layers each: attention, moe"),  # as released
    ("*E", "supported", "2 layers each: attention, moe"),  # the older pattern string
    (None, "supported", "2 layers each: attention, moe"),  # no field: transformers' default
    (["attention", "mlp"], "supported", "2 layers each: attention, mlp"),
    (["attention", "moe", "moe"], "unsupported", "4 MTP layer(s)"),  # not whole heads of 3
    (["mamba", "attention"], "unsupported", "Mamba block"),
    (["moe", "moe"], "unsupported", "exactly one attention block"),
    ("*Q", "unsupported", "does not know"),
])
def test_nemotron_h_block_types(tmp_path, blocks, status, said):
    """Nemotron-H heads span as many layers as the config names MTP blocks, in either
    spelling; heads this engine cannot run (recurrent state, no or two KV caches) are
    unsupported with the reason."""
    folder = write_layout("nemotron_h", tmp_path, mtp_heads=2)
    config = json.loads((folder / "config.json").read_text())
    del config["mtp_layers_block_type"]
    if isinstance(blocks, str):
        config["mtp_hybrid_override_pattern"] = blocks
    elif blocks is not None:
        config["mtp_layers_block_type"] = blocks
    (folder / "config.json").write_text(json.dumps(config))
    report = inspect_checkpoint(folder)
    assert (report.family, report.status) == ("nemotron_h", status) and said in report.reason, report.reason
    assert (report.mtp_heads, report.depth_max) == ((2, 4) if status == "supported" else (report.mtp_heads, 0))


def test_nemotron_h_repeated_head_counts_by_weights(tmp_path):
    """A config counting more depths than the weights hold heads (a head trained to be
    reused): the weights decide, and depths beyond reuse the last head."""
    report = inspect_checkpoint(write_layout("nemotron_h", tmp_path, mtp_heads=1, config_heads=2))
    assert (report.status, report.mtp_heads, report.depth_max) == ("supported", 1, 4)
    assert "num_nextn_predict_layers=2" in report.reason


def test_deepseek_v4_heads_are_supported(tmp_path):
    """DeepSeek-V4's heads (`mtp.{i}.*`, separate e_proj / h_proj, their own hc_head_*) run
    on the trunk engine/backends/deepseek_v4.py writes (mlx-lm has none): supported with
    heads; without them AR-only through the same backend, never `plain`; a partial head
    is unsupported and says what is missing. (Config values and weight formats the backend
    does not implement: unsupported here and refused at load, tests/test_backends_deepseek_v4.py.)"""
    report = inspect_checkpoint(write_layout("deepseek_v4", tmp_path / "a", mtp_heads=1))
    assert (report.family, report.status, report.mtp_heads, report.depth_max) == ("deepseek_v4", "supported", 1, 4)
    assert report.descriptor.backend_module == "engine.backends.deepseek_v4" and report.descriptor.own_trunk
    assert "1 MTP head(s) at mtp.{i}.*" in report.reason
    assert report.head_keys_found and report.head_keys_found[0].startswith("mtp.0.")
    bare = inspect_checkpoint(write_layout("deepseek_v4", tmp_path / "b", mtp_heads=0, config_heads=1))
    assert (bare.status, bare.mtp_heads, bare.descriptor.backend_module) == (
        "ar-only", 0, "engine.backends.deepseek_v4")
    assert "no MTP head weights found (looked for mtp.{i}.*)" in bare.reason
    partial = inspect_checkpoint(write_layout("deepseek_v4", tmp_path / "c", mtp_heads=1, drop=("mtp.0.h_proj",)))
    assert partial.status == "unsupported" and "missing mtp.0.h_proj.weight" in partial.reason
    result = cli("inspect", "--json", str(tmp_path / "a"))
    assert result.returncode == 0 and json.loads(result.stdout)["status"] == "supported"


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "mistral"])
def test_ar_only_model(tmp_path, model_type):
    report = inspect_checkpoint(write_layout(model_type, tmp_path))
    assert (report.family, report.status, report.mtp_heads) == (model_type, "ar-only", 0)
    assert report.descriptor.backend_module == PLAIN_BACKEND
    assert model_type in report.reason and "looked for" in report.reason
    assert "mtp_layers" in report.reason and "eh_proj" in report.reason


def test_ar_only_model_with_foreign_mtp_weights(tmp_path):
    # A model_type mlx-lm builds, with no MTP backend here: its head is ignored.
    folder = write_layout("mimo", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    report = inspect_checkpoint(folder)
    assert (report.family, report.status, report.mtp_heads) == ("qwen2", "ar-only", 0)
    assert "model.mtp_layers.0." in report.reason


def test_unknown_model_type(tmp_path):
    report = inspect_checkpoint(write_layout("frobnicator", tmp_path))
    assert (report.family, report.status, report.descriptor) == ("frobnicator", "unsupported", None)
    assert "mlx-lm cannot build" in report.reason


# --- the CLI ----------------------------------------------------------------------------

def test_cli_json_keys(tmp_path):
    result = cli("inspect", str(write_layout("qwen3_5_moe", tmp_path, mtp_heads=2)), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert list(data) == ["family", "mtp_heads", "depth_max", "status", "reason"]
    assert (data["family"], data["mtp_heads"], data["depth_max"], data["status"]) == (
        "qwen3_5_moe", 2, 4, "supported")
    assert "mtp.layers.{i}." in data["reason"]


@pytest.mark.parametrize("layout, options, status, code", [
    ("mimo", {}, "supported", 0),
    ("qwen2", {}, "ar-only", 3),
    ("glm4_moe", {"mtp_heads": 0, "config_heads": 1}, "ar-only", 3),
    ("frobnicator", {}, "unsupported", 4),
    ("deepseek_v3", {"drop": ("eh_proj",)}, "unsupported", 4),
])
def test_cli_exit_codes(tmp_path, layout, options, status, code):
    folder = str(write_layout(layout, tmp_path, **options))
    as_json, human = cli("inspect", "--json", folder), cli("inspect", folder, module=False)
    assert (as_json.returncode, human.returncode) == (code, code), human.stderr
    assert json.loads(as_json.stdout)["status"] == status
    assert f"status:    {status}" in human.stdout and as_json.stderr == human.stderr == ""


def test_cli_human_report(tmp_path):
    result = cli("inspect", str(write_layout("qwen3_next", tmp_path, mtp_heads=2)))
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert {k: v.strip() for k, v in lines.items() if k != "reason"} == {
        "family": "qwen3_next", "MTP heads": "2", "depth": "1-4", "status": "supported",
        "backend": "engine.backends.qwen3_next",
    }


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`mtplxd inspect M | head -1`: the reader is gone before the report is
    written; the command stops without a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mtplxd", "inspect", str(write_layout("qwen3_next", tmp_path, mtp_heads=2))]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    proc.stdout.close()  # long before the interpreter has started
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == ""


def test_cli_help_and_no_command():
    assert cli("--help").returncode == 0 and "inspect" in cli("--help").stdout
    assert cli().returncode == 2


# --- unreadable checkpoints: exit 2, one line on stderr -----------------------------------

def _truncate(folder: Path, keep: int) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:keep])


def _break(case: str, folder: Path) -> Path:
    if case == "missing path":
        return folder / "nowhere"
    write_layout("mimo", folder, shards=2 if case == "index names missing shard" else 1)
    if case == "no config.json":
        (folder / "config.json").unlink()
    elif case == "malformed config.json":
        (folder / "config.json").write_text('{"model_type": "mimo",')
    elif case == "config without model_type":
        (folder / "config.json").write_text('{"hidden_size": 8}')
    elif case == "truncated header":
        _truncate(folder, 40)
    elif case == "truncated data":
        _truncate(folder, (folder / "model.safetensors").stat().st_size - 2)
    elif case == "corrupt header":
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"[1,2]")
    elif case == "no weights":
        (folder / "model.safetensors").unlink()
    elif case == "index names missing shard":
        (folder / "model-00002-of-00002.safetensors").unlink()
    return folder


BROKEN = {
    "missing path": "nowhere", "no config.json": "no config.json",
    "malformed config.json": "malformed JSON", "config without model_type": "no model_type",
    "truncated header": "truncated", "truncated data": "truncated",
    "corrupt header": "corrupt", "no weights": "no safetensors",
    "index names missing shard": "missing shard",
}


@pytest.mark.parametrize("case", BROKEN)
def test_unreadable_checkpoint(tmp_path, case):
    folder = _break(case, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=BROKEN[case]):
        inspect_checkpoint(folder)
    for as_json in ([], ["--json"]):
        result = cli("inspect", str(folder), *as_json)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith("mtplxd inspect: ") and BROKEN[case] in result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
