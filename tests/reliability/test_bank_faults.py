"""Session-bank faults through the real daemon: `kill -9` in the middle of a background
write, bank files corrupted or truncated, and snapshots of another model. Each is a miss
at worst: nothing is lost that was written, nothing corrupt is served, the daemon serves."""

from __future__ import annotations

import signal

from tests.daemon_fixture import running_daemon, stop_process
from tests.test_sessions_http import (  # noqa: F401  (mimo, mimo_other: fixtures)
    FAST_WRITES, LAST, TEXT, clients, complete, metric, mimo, mimo_other, wait_until, written,
)


def test_kill_9_in_the_middle_of_a_background_write(tmp_path, mimo):
    state, ws = tmp_path / "state", tmp_path / "ws"
    ws.mkdir()
    slow = {"MTPLXD_SESSION_WRITE_DELAY_MS": "0", "MTPLXD_SESSION_WRITE_BPS": "50000"}  # 50 KB/s
    small = TEXT[:200]
    big = "".join(f"value_{i} = [{i}, {i + 1}, {i + 2}]\n" for i in range(110))  # ~2,700 tokens: ~1 MB
    with running_daemon(state, mimo, env=slow) as d:
        client, http = clients(d)
        complete(client, small, str(ws), max_tokens=1)
        n = LAST["prompt_tokens"]
        wait_until(lambda: written(http), timeout=60, what="the first entry on disk")
        complete(client, big, str(ws), max_tokens=1)
        folder = wait_until(lambda: next((p.parent for p in (state / "sessions").glob("*/.*.tmp")), None),
                            what="a write in progress")
        stop_process(d.process, signal.SIGKILL)
    assert list(folder.glob(".*.tmp")), "the write finished before the kill"
    with running_daemon(state, mimo) as d:
        client, http = clients(d)
        assert not list(folder.glob(".*.tmp"))
        warm, cached = complete(client, small + "# x", str(ws), max_tokens=8)
        cold, _ = complete(client, small + "# x", str(tmp_path), max_tokens=8)
        assert cached >= n and warm == cold
        _, cached = complete(client, big, str(ws), max_tokens=1)
        assert cached == 0  # the interrupted entry is lost, nothing worse
        assert metric(http, "mtplxd_session_bad_files_total") == 0


def test_bad_files_and_a_model_change_are_misses(tmp_path, mimo, mimo_other):
    state, ws = tmp_path / "state", tmp_path / "ws"
    ws.mkdir()
    prompt = TEXT + "# x\n"
    with running_daemon(state, mimo, env=FAST_WRITES) as d:
        client, http = clients(d)
        complete(client, TEXT, str(ws))
        wait_until(lambda: written(http), what="background writes")
    with running_daemon(state, mimo_other) as d:  # another model, same state dir
        client, http = clients(d)
        text, cached = complete(client, prompt, str(ws))
        cold, _ = complete(client, prompt, str(tmp_path))
        assert cached == 0 and text == cold
    files = [p for p in (state / "sessions").glob("*/*.safetensors")]
    assert files
    for i, path in enumerate(files):  # corrupt (every file of both models) or truncate
        data = bytearray(path.read_bytes())
        if i % 2:
            data = data[: len(data) // 2]
        else:
            data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    with running_daemon(state, mimo) as d:
        client, http = clients(d)
        text, cached = complete(client, prompt, str(ws))
        cold, _ = complete(client, prompt, str(tmp_path / "elsewhere"))
        assert cached == 0 and text == cold
        assert metric(http, "mtplxd_session_bad_files_total") >= 1
        assert http.get("/health").json()["status"] == "ok"
    assert list((state / "sessions").glob("*/*.bad"))
