"""The session bank on real tiny checkpoints: restored generations are exact, keys and
workspaces, RAM and disk tiers, bad files, warm-ups through the scheduler."""

from __future__ import annotations

import hashlib
import json
import shutil
import time

import anyio
import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from engine.generation import GenerationRequest
from engine.sampling import SamplerSettings
from engine.sessions.bank import MANIFEST, SessionBank
from engine.sessions.files import read_snapshot, snapshot_metadata, write_snapshot
from engine.sessions.arrays import describe
from engine.sessions.state import LayerState, Restore
from mtplxd.requests import Done, Priority, TextRequest, WarmRequest, Warmed
from mtplxd.config import Settings
from mtplxd.runtime import Runtime
from mtplxd.scheduler import Scheduler
from tests.checkpoints import write
from tests.engine_helpers import assert_caches_close, feed_one_by_one, load_family, reference_head_caches, run
from tests.floats import LONG_PATHS_ULPS

HOT = SamplerSettings(temperature=1.0)
KW = dict(sampler=HOT, depth=2, max_tokens=24, seed=11)
# attention-only, hybrid (GatedDeltaNet), then MoE trunks with sliding windows (MiMo-V2-Flash,
# Step-3.5) and with GLM-5's sparse attention, whose indexer keys sit in the attention cache;
# Hy-V3, whose trunk is written in its backend; Nemotron-H, a hybrid with Mamba2 state; DeepSeek-V4,
# whose compressor inputs and compressed entries sit in its attention caches
FAMILIES = ["mimo", "qwen3_next", "mimo_v2_flash", "step3p5", "glm_moe_dsa", "hy_v3", "nemotron_h", "deepseek_v4"]
MiB = 1 << 20


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(7, 60, n)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    return {
        "mimo": load_family(root, "mimo", mtp_heads=2),
        "qwen3_next": load_family(root, "qwen3_next", mtp_heads=1),
        **{family: load_family(root, family, mtp_heads=2) for family in FAMILIES[2:]},
    }


@pytest.fixture(scope="module")
def keys(engines):
    return {family: describe(engine) for family, engine in engines.items()}


def ram_bank(key, ram=64 * MiB) -> SessionBank:
    bank = SessionBank(None, ram)
    bank.attach(key)
    return bank


def disk_bank(folder, key, ram=64 * MiB, disk=64 * MiB, **kw) -> SessionBank:
    bank = SessionBank(folder, ram, disk, write_delay_s=kw.pop("write_delay_s", 0.0), **kw)
    bank.attach(key)
    return bank


def banked(engine, bank, prompt, workspace="/ws", **kw):
    """What a TextJob does: look up, restore, snapshot at the end of the prompt and at the end.
    Returns (generated ids, generation, restore)."""
    options = {**KW, **kw}
    request = GenerationRequest(prompt=tuple(prompt), **options)
    restore = bank.lookup(workspace, prompt)
    gen = engine.open(request, restore=restore, record=True)
    snapped = False
    while not gen.finished:
        if gen.started and not snapped:
            snapped = True
            if bank.wants(workspace, gen.fed_tokens, gen.has_logits):
                bank.add(workspace, gen.snapshot())
        gen.step()
    if bank.wants(workspace, gen.fed_tokens, gen.has_logits):
        bank.add(workspace, gen.snapshot())
    return gen.tokens[len(prompt):], gen, restore


def cold(engine, prompt, **kw):
    out, _, _ = run(engine, prompt, **{**KW, **kw})
    return out


# -- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_is_reused_and_output_equals_cold(engines, keys, family):
    engine, bank = engines[family], ram_bank(keys[family])
    first = tokens(1, 300)  # crosses a 256-token block
    out, _, restore = banked(engine, bank, first)
    assert restore is None and out == cold(engine, first)
    second = first + tokens(2, 40)
    out, gen, restore = banked(engine, bank, second)
    assert restore is not None and gen.reused == 300
    assert out == cold(engine, second)
    again, gen, restore = banked(engine, bank, first)  # the same prompt once more
    assert gen.reused >= 299 and again == cold(engine, first)
    if family == "qwen3_next":
        assert gen.reused == 300  # whole snapshot: the first token from the stored logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("depth_before,depth_after,mode", [(1, 3, "mtp"), (3, 1, "mtp"), (2, 2, "ar")])
def test_restore_across_depths_and_modes(engines, keys, family, depth_before, depth_after, mode):
    engine, bank = engines[family], ram_bank(keys[family])
    first = tokens(3, 120)
    banked(engine, bank, first, depth=depth_before)
    second = first + tokens(4, 30)
    out, gen, _ = banked(engine, bank, second, depth=depth_after, mode=mode)
    assert gen.reused == 120
    assert out == cold(engine, second, depth=depth_after, mode=mode)


@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_generation_snapshot_continues_a_conversation(engines, keys, family):
    engine, bank = engines[family], ram_bank(keys[family])
    first = tokens(5, 60)
    _, gen, _ = banked(engine, bank, first)
    fed = gen.fed_tokens  # prompt + reply, as the next turn resends it
    second = fed + tokens(6, 25)
    out, gen, _ = banked(engine, bank, second)
    assert gen.reused == len(fed)
    assert out == cold(engine, second)


@pytest.mark.parametrize("family", FAMILIES)
def test_restored_caches_equal_feeding_one_by_one(engines, keys, family):
    """The generation's own invariant (tests/test_engine.py) holds after a restore, also
    after a cut (attention-only) that resets the head caches to a common offset."""
    engine, bank = engines[family], ram_bank(keys[family])
    backend = engine.backend
    first = tokens(7, 90)
    _, gen, _ = banked(engine, bank, first, depth=2)
    long = gen.fed_tokens
    cut = keys[family].layout.trimmable  # attention-only: a prefix of a snapshot serves
    second = long[:70] + tokens(8, 20) if cut else long + tokens(8, 20)
    restore = bank.lookup("/ws", second)
    assert restore is not None and restore.length == (70 if cut else len(long))
    gen = engine.open(GenerationRequest(prompt=tuple(second), **{**KW, "max_tokens": 30}), restore=restore)
    while not gen.finished:
        gen.step()
    fed = gen.tokens[: gen._fed]
    ref_cache, ref_hidden = feed_one_by_one(backend, fed)
    assert_caches_close(gen.cache, ref_cache, LONG_PATHS_ULPS, "trunk cache")
    offsets = [c.offset for c in gen.head_caches]
    ref_heads = reference_head_caches(backend, gen.tokens, ref_hidden, offsets)
    assert_caches_close(gen.head_caches, ref_heads, LONG_PATHS_ULPS, "head caches")


def _digest(snapshot) -> str:
    h = hashlib.sha256(snapshot.tokens.tobytes())
    for t in snapshot.tensors():
        assert not t.data.flags.writeable
        h.update(t.data.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_entries_are_never_mutated(engines, keys, family):
    engine, bank = engines[family], ram_bank(keys[family])
    first = tokens(9, 280)
    banked(engine, bank, first)
    stored = [e.snapshot for e in bank._entries.values()]
    before = [_digest(s) for s in stored]
    for i, cut in enumerate((280, 279, 200)):  # whole, and cuts where the model allows them
        prompt = first[:cut] + tokens(10 + i, 15)
        restore = bank.lookup("/ws", prompt)
        if restore is None:
            continue
        gen = engine.open(GenerationRequest(prompt=tuple(prompt), **KW), restore=restore)
        while not gen.finished:
            gen.step()
        mx.eval([c.state for c in gen.cache])
    assert [_digest(s) for s in stored] == before


def test_hybrid_reuses_whole_snapshots_only(engines, keys):
    engine, bank = engines["qwen3_next"], ram_bank(keys["qwen3_next"])
    first = tokens(11, 100)
    banked(engine, bank, first, max_tokens=1)
    assert bank.lookup("/ws", first[:80] + tokens(12, 30)) is None  # recurrent state cannot be cut
    restore = bank.lookup("/ws", first + tokens(12, 30))
    assert restore is not None and restore.length == 100


def test_attention_only_reuses_any_prefix(engines, keys):
    engine, bank = engines["mimo"], ram_bank(keys["mimo"])
    first = tokens(13, 600)
    banked(engine, bank, first, max_tokens=1)
    for cut in (1, 255, 256, 257, 513):
        restore = bank.lookup("/ws", first[:cut] + [7, 8, 9])
        assert restore is not None and restore.length == cut


def test_workspaces_are_isolated(engines, keys):
    engine, bank = engines["mimo"], ram_bank(keys["mimo"])
    first = tokens(14, 50)
    banked(engine, bank, first, workspace="/a")
    prompt = first + [9, 9]
    assert bank.lookup("/b", prompt) is None
    assert bank.lookup(None, prompt) is None  # the default namespace
    assert bank.lookup("/a", prompt).length == 50
    names = {s.workspace: s for s in bank.workspaces()}
    assert names["/a"].hits == 1 and names["/b"].misses == 1 and names[""].misses == 1
    assert bank.clear("/a") >= 1 and bank.lookup("/a", prompt) is None


# -- tiers -----------------------------------------------------------------------------------


def test_ram_eviction_under_a_byte_budget(engines, keys):
    engine = engines["mimo"]
    probe = ram_bank(keys["mimo"])
    banked(engine, probe, tokens(15, 200), max_tokens=1)
    size = probe.stats().ram_bytes
    bank = ram_bank(keys["mimo"], ram=int(size * 2.5))
    prompts = [tokens(20 + i, 200) for i in range(4)]
    for prompt in prompts:
        banked(engine, bank, prompt, max_tokens=1)
    stats = bank.stats()
    assert stats.ram_bytes <= bank.ram_budget and stats.ram_entries == 2 and stats.evictions_ram == 2
    assert bank.lookup("/ws", prompts[0] + [7]) is None  # least recently used went first
    assert bank.lookup("/ws", prompts[3] + [7]) is not None


def test_eviction_takes_leaves_before_shared_prefixes(engines, keys):
    engine = engines["qwen3_next"]  # hybrid: a prefix entry stays useful beside its extensions
    base = tokens(30, 150)
    probe = ram_bank(keys["qwen3_next"])
    banked(engine, probe, base, max_tokens=1)
    size = probe.stats().ram_bytes
    bank = ram_bank(keys["qwen3_next"], ram=int(size * 2.5))
    banked(engine, bank, base, max_tokens=1)  # the shared prefix, oldest
    banked(engine, bank, base + tokens(31, 20), max_tokens=1)  # a leaf extending it
    banked(engine, bank, tokens(32, 150), max_tokens=1)  # an unrelated leaf: one must go
    assert bank.stats().evictions_ram == 1
    assert bank.lookup("/ws", base + tokens(33, 5)).length == 150  # the prefix survived
    assert bank.lookup("/ws", base + tokens(31, 20) + [7]).length == 150  # its older leaf did not


@pytest.mark.parametrize("family", FAMILIES)
def test_disk_tier_survives_a_restart(tmp_path, engines, keys, family):
    engine = engines[family]
    bank = disk_bank(tmp_path, keys[family], write_delay_s=30.0)  # only the close writes
    first = tokens(40, 300)
    _, first_gen, _ = banked(engine, bank, first)
    assert bank.stats().disk_entries == 0
    assert bank.close(10)
    folder = tmp_path / keys[family].fingerprint[:16]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["entries"] and all(len(r["sha256"]) == 64 for r in manifest["entries"])
    for record in manifest["entries"]:  # real safetensors files
        from safetensors import safe_open

        with safe_open(str(folder / record["file"]), "np") as f:
            assert "tokens" in f.keys()
    second = first + tokens(41, 30)
    bank = disk_bank(tmp_path, keys[family])
    out, gen, restore = banked(engine, bank, second)
    # The prompt's 300 tokens; with an attention-only model, also the generated tokens
    # that happen to begin the new suffix (the end-of-generation snapshot serves them).
    shared = next(i for i, (a, b) in enumerate(zip([*first_gen.fed_tokens, None], second)) if a != b)
    assert restore.tier == "disk" and gen.reused == (shared if keys[family].layout.trimmable else 300) >= 300
    assert out == cold(engine, second)
    assert bank.lookup("/ws", second).tier == "ram"  # promoted
    assert bank.stats().hits_disk == 1
    bank.close()


def _write_all(bank):
    assert bank.flush(10)


def test_corrupt_truncated_and_foreign_files_are_misses(tmp_path, engines, keys):
    engine, key = engines["mimo"], keys["mimo"]
    bank = disk_bank(tmp_path, key)
    prompts = {name: tokens(50 + i, 120) for i, name in enumerate(("corrupt", "truncated", "good"))}
    for name, prompt in prompts.items():
        banked(engine, bank, prompt, workspace=f"/{name}", max_tokens=1)
    bank.close()
    folder = tmp_path / key.fingerprint[:16]
    records = {r["workspace"]: r for r in json.loads((folder / MANIFEST).read_text())["entries"]}
    path = folder / records["/corrupt"]["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    path = folder / records["/truncated"]["file"]
    path.write_bytes(path.read_bytes()[:-100])
    # a file of another model, listed with its right checksum: the fingerprint stops it
    other = describe(engines["qwen3_next"])
    foreign_bank = disk_bank(tmp_path / "other", other)
    banked(engines["qwen3_next"], foreign_bank, prompts["good"], workspace="/foreign", max_tokens=1)
    foreign_bank.close()
    foreign_folder = tmp_path / "other" / other.fingerprint[:16]
    foreign = json.loads((foreign_folder / MANIFEST).read_text())["entries"][0]
    shutil.copy(foreign_folder / foreign["file"], folder / foreign["file"])
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["entries"].append(foreign)
    (folder / MANIFEST).write_text(json.dumps(manifest))

    bank = disk_bank(tmp_path, key)
    assert bank.stats().bad_files == 2  # truncated and foreign, caught from their headers at start
    for name in ("corrupt", "truncated"):
        prompt = prompts[name] + [7, 8]
        out, gen, restore = banked(engine, bank, prompt, workspace=f"/{name}")
        assert restore is None and gen.reused == 0
        assert out == cold(engine, prompt)
    assert bank.lookup("/foreign", prompts["good"] + [7]) is None
    assert bank.lookup("/good", prompts["good"] + [7]).tier == "disk"
    stats = bank.stats()
    assert stats.bad_files == 3 and stats.misses >= 3
    assert len(list(folder.glob("*.bad"))) == 3
    bank.close()


def test_a_file_that_does_not_fit_the_model_is_set_aside(tmp_path, engines, keys):
    """Right checksum and fingerprint, wrong shapes (offset != n_tokens): never used."""
    engine, key = engines["mimo"], keys["mimo"]
    bank = ram_bank(key)
    banked(engine, bank, tokens(60, 80), max_tokens=1)
    snapshot = next(iter(bank._entries.values())).snapshot
    keys_, values = snapshot.layers[0].tensors
    snapshot.layers[0] = LayerState("kv", [keys_.slice_seq(2, 0, 79), values.slice_seq(2, 0, 79)])
    folder = tmp_path / key.fingerprint[:16]
    folder.mkdir()
    sha, size = write_snapshot(folder, "x.safetensors", snapshot, snapshot_metadata(snapshot, key.fingerprint, "/ws"))
    record = {"file": "x.safetensors", "sha256": sha, "bytes": size, "workspace": "/ws", "n_tokens": 80}
    (folder / MANIFEST).write_text(json.dumps({"format": "mtplxd-session/1", "fingerprint": key.fingerprint,
                                               "entries": [record]}))
    bank = disk_bank(tmp_path, key)
    assert bank.lookup("/ws", tokens(60, 80) + [7]) is None
    assert (folder / "x.safetensors.bad").exists() and bank.stats().bad_files == 1
    bank.close()


def test_crash_leftovers_are_cleaned_and_complete_files_adopted(tmp_path, engines, keys):
    """What `kill -9` can leave: a temp file half written, a complete file the manifest does
    not list yet, a manifest that lists a file that is gone, or a garbled manifest."""
    engine, key = engines["mimo"], keys["mimo"]
    bank = disk_bank(tmp_path, key)
    a, b = tokens(70, 100), tokens(71, 100)
    banked(engine, bank, a, workspace="/ws", max_tokens=1)
    banked(engine, bank, b, workspace="/ws", max_tokens=1)
    bank.close()
    folder = tmp_path / key.fingerprint[:16]
    manifest = json.loads((folder / MANIFEST).read_text())
    listed = {r["file"] for r in manifest["entries"]}
    (folder / ".deadbeef.safetensors.tmp").write_bytes(b"\0" * 1000)
    manifest["entries"] = manifest["entries"][:1] + [{**manifest["entries"][0], "file": "gone.safetensors"}]
    (folder / MANIFEST).write_text(json.dumps(manifest))  # the second file is now an orphan
    bank = disk_bank(tmp_path, key)
    assert not list(folder.glob("*.tmp")) and bank.stats().bad_files == 0
    assert bank.lookup("/ws", a + [7]).length == 100 and bank.lookup("/ws", b + [7]).length == 100
    bank.close()
    assert {r["file"] for r in json.loads((folder / MANIFEST).read_text())["entries"]} == listed
    (folder / MANIFEST).write_text("{not json")
    bank = disk_bank(tmp_path, key)  # every file adopted from its own header and data checksum
    assert bank.lookup("/ws", a + [7]).length == 100 and bank.lookup("/ws", b + [7]).length == 100
    bank.close()


def test_another_model_on_the_same_folder_misses(tmp_path, engines, keys):
    bank = disk_bank(tmp_path, keys["mimo"])
    first = tokens(80, 100)
    banked(engines["mimo"], bank, first, max_tokens=1)
    bank.close()
    other = load_family(tmp_path / "other", "mimo", mtp_heads=2, seed=1)  # same shapes, other weights
    other_key = describe(other)
    assert other_key.fingerprint != keys["mimo"].fingerprint
    bank = disk_bank(tmp_path, other_key)
    prompt = first + [7, 8]
    out, gen, restore = banked(other, bank, prompt)
    assert restore is None and out == cold(other, prompt)
    bank.close()


def test_disk_budget_evicts_least_recently_used(tmp_path, engines, keys):
    engine, key = engines["mimo"], keys["mimo"]
    bank = disk_bank(tmp_path, key)
    banked(engine, bank, tokens(90, 200), max_tokens=1)
    _write_all(bank)
    size = bank.stats().disk_bytes
    bank.close()
    shutil.rmtree(tmp_path / key.fingerprint[:16])
    bank = disk_bank(tmp_path, key, ram=size, disk=int(size * 2.5))
    prompts = [tokens(91 + i, 200) for i in range(4)]
    for prompt in prompts:
        banked(engine, bank, prompt, max_tokens=1)
        _write_all(bank)
    stats = bank.stats()
    assert stats.disk_entries == 2 and stats.evictions_disk == 2 and stats.disk_bytes <= bank.disk_budget
    bank.close()
    folder = tmp_path / key.fingerprint[:16]
    assert len(list(folder.glob("*.safetensors"))) == 2
    bank = disk_bank(tmp_path, key, ram=size, disk=int(size * 2.5))
    assert bank.lookup("/ws", prompts[0] + [7]) is None and bank.lookup("/ws", prompts[3] + [7]) is not None
    bank.close()


def test_throttled_write_is_aborted_by_clear(tmp_path, engines, keys):
    engine, key = engines["mimo"], keys["mimo"]
    bank = disk_bank(tmp_path, key, write_bps=20_000)
    banked(engine, bank, tokens(95, 400), max_tokens=1)
    folder = tmp_path / key.fingerprint[:16]
    for _ in range(200):
        if list(folder.glob(".*.tmp")):
            break
        time.sleep(0.02)
    assert list(folder.glob(".*.tmp")), "the write never started"
    assert bank.clear("/ws") == 1
    bank.close(5)
    assert not list(folder.glob("*.safetensors")) and not list(folder.glob(".*.tmp"))


def test_snapshot_file_round_trip_is_bit_exact(tmp_path, engines, keys):
    engine, key = engines["qwen3_next"], keys["qwen3_next"]
    bank = ram_bank(key)
    banked(engine, bank, tokens(96, 70))
    for i, entry in enumerate(bank._entries.values()):
        s = entry.snapshot
        sha, _ = write_snapshot(tmp_path, f"{i}.safetensors", s, snapshot_metadata(s, key.fingerprint, "/ws"))
        back, metadata = read_snapshot(tmp_path / f"{i}.safetensors", sha, key.fingerprint, key.layout)
        assert metadata["workspace"] == "/ws" and _digest(back) == _digest(s)


# -- through the scheduler -----------------------------------------------------------------------


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_scheduler_reports_cached_tokens_and_warms_up(tmp_path, engines, keys):
    engine = engines["mimo"]
    bank = SessionBank(None, 64 * MiB)
    scheduler = Scheduler(lambda: engine, bank=bank)
    seen = []
    registry = type("Registry", (), {"register": staticmethod(seen.append)})()  # what the daemon's watcher is told
    runtime = Runtime(scheduler, Settings(state_dir=tmp_path), registry)
    prompt = tuple(tokens(97, 150))

    async def done(request) -> list:
        return [e async for e in runtime.submit(request)]

    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        warm = await done(WarmRequest(prompt, "/w"))
        assert isinstance(warm[-1], Warmed) and warm[-1].stored == 1 and warm[-1].cached_tokens == 0
        again = await done(WarmRequest(prompt, "/w"))
        assert again[-1].cached_tokens == len(prompt) and again[-1].stored == 0
        request = TextRequest(prompt + (9, 10), max_tokens=8, sampler=HOT, seed=3, workspace="/w",
                              priority=Priority.INTERACTIVE)
        events = await done(request)
        assert isinstance(events[-1], Done) and events[-1].usage.cached_tokens == len(prompt)
        other = await done(TextRequest(prompt + (9, 10), max_tokens=8, sampler=HOT, seed=3, workspace="/other"))
        assert other[-1].usage.cached_tokens == 0
        assert [t for e in events[:-1] for t in e.token_ids] == [t for e in other[:-1] for t in e.token_ids]
        scheduler.stop()
    assert seen == ["/w", "/other"]
