"""The daemon's settings, lifecycle and CLI: start / stop / status, as users run them."""

from __future__ import annotations

import http.client
import json
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import anyio
import pytest

from mtplxd import client
from mtplxd.config import ConfigError, Settings, load_settings
from tests.checkpoints import write
from tests.daemon_fixture import daemon_env, mtplxd_command, running_daemon, stop_process


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write("mimo", tmp_path_factory.mktemp("ckpt") / "m", mtp_heads=1)


def mtplxd(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([*mtplxd_command(), *args], env=daemon_env(), capture_output=True, text=True,
                          timeout=timeout)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- settings ------------------------------------------------------------------------


def test_defaults(tmp_path):
    s = load_settings({}, environ={"MTPLXD_HOME": str(tmp_path)})
    assert (s.host, s.port, s.state_dir, s.model, s.profile, s.depth, s.api_key) == (
        "127.0.0.1", 8765, tmp_path, None, None, None, None)  # profile and depth: measured per model
    assert (s.max_active, s.max_queued, s.interactive_reserve, s.log_level) == (8, 64, 2, "info")
    assert s.model_path.name == "assets"


def test_state_dir_resolution(tmp_path):
    home = Path.home()
    linux = load_settings({}, environ={"XDG_STATE_HOME": str(tmp_path)}).state_dir
    assert linux in (tmp_path / "mtplxd", home / "Library" / "Application Support" / "mtplxd")
    env = {"MTPLXD_HOME": str(tmp_path / "a"), "MTPLXD_STATE_DIR": str(tmp_path / "b")}
    assert load_settings({}, environ=env).state_dir == tmp_path / "b"
    assert load_settings({"state_dir": str(tmp_path / "c")}, environ=env).state_dir == tmp_path / "c"


def test_precedence_defaults_file_env_flags(tmp_path):
    (tmp_path / "config.toml").write_text('port = 1111\ndepth = 3\nprofile = "burst"\nlog_level = "debug"\n')
    env = {"MTPLXD_HOME": str(tmp_path), "MTPLXD_PORT": "2222", "MTPLXD_DEPTH": "4"}
    s = load_settings({"port": 3333}, environ=env)
    assert (s.port, s.depth, s.profile, s.log_level, s.max_active) == (3333, 4, "burst", "debug", 8)
    s = load_settings({}, environ=env)
    assert (s.port, s.depth) == (2222, 4)
    explicit = tmp_path / "other.toml"
    explicit.write_text(f'max_queued = 5\nstate_dir = "{tmp_path / "s"}"\n')
    s = load_settings({}, config_file=explicit, environ={"MTPLXD_HOME": str(tmp_path)})
    assert (s.max_queued, s.port, s.state_dir) == (5, 8765, tmp_path / "s")  # the implicit file is not read


@pytest.mark.parametrize(
    "toml, env, flags, message",
    [
        ("colour = 1\n", {}, {}, "unknown key 'colour'"),
        ('port = "80"\n', {}, {}, "port: expected an integer"),
        ("port = [\n", {}, {}, "not valid TOML"),
        ('state_dir = "/x"\n', {}, {}, "state_dir cannot be set"),
        ("", {"MTPLXD_PORT": "abc"}, {}, "MTPLXD_PORT: port: expected an integer, got 'abc'"),
        ("", {}, {"port": 70000}, "port: must be between 0 and 65535"),
        ("", {"MTPLXD_LOG_LEVEL": "loud"}, {}, "log_level: must be one of"),
        ("", {}, {"depth": 0}, "depth: must be at least 1"),
        ('profile = "warp"\n', {}, {}, "profile: must be one of sustained, burst, turbo"),
        ("max_active = true\n", {}, {}, "max_active: expected an integer"),
        ("patience_normal = 0\n", {}, {}, "patience_normal: must be at least 1, got 0"),
        ("", {"MTPLXD_PATIENCE_BACKGROUND": "-1"}, {}, "patience_background: must be at least 1"),
    ],
)
def test_validation_errors_are_one_line(tmp_path, toml, env, flags, message):
    (tmp_path / "config.toml").write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_settings(flags, environ={"MTPLXD_HOME": str(tmp_path), **env})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings({}, config_file=tmp_path / "nope.toml", environ={"MTPLXD_HOME": str(tmp_path)})


def test_non_loopback_needs_an_api_key(tmp_path):
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert Settings(host=host, state_dir=tmp_path).host == host
    with pytest.raises(ConfigError, match="without an API key"):
        Settings(host="0.0.0.0", state_dir=tmp_path)
    assert Settings(host="0.0.0.0", api_key="k", state_dir=tmp_path).api_key == "k"
    run = mtplxd("start", "--host", "0.0.0.0", "--state-dir", str(tmp_path))
    assert run.returncode == 2 and "without an API key" in run.stderr
    assert not (tmp_path / "daemon.pid").exists()


def test_missing_embedded_model_hint(tmp_path):
    assert Settings(model=tmp_path, state_dir=tmp_path).missing_model_hint() is None
    default = Settings(state_dir=tmp_path)
    installed = (default.model_path / "config.json").is_file()
    hint = default.missing_model_hint()
    assert (hint is None) == installed
    if hint:
        assert "no embedded model is installed yet" in hint and "--model PATH" in hint


# -- the daemon, as users start it -----------------------------------------------------


def test_lifecycle_status_stop_restart(tmp_path, model):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)  # an existing, too-open state dir gets tightened
    with running_daemon(state, model) as daemon:
        assert mode(state) == 0o700 and mode(state / "logs") == 0o700
        for name in ("daemon.pid", "daemon.json", "logs/daemon.log"):
            assert mode(state / name) == 0o600, name
        info = json.loads((state / "daemon.json").read_text())
        assert info["pid"] == daemon.process.pid and daemon.base_url.endswith(f":{info['port']}")
        assert set(info) == {"host", "port", "pid", "version", "started_at"}
        assert client.read_address(state) == ("127.0.0.1", info["port"])

        status = mtplxd("status", "--state-dir", str(state))
        assert status.returncode == 0, status.stderr
        assert daemon.base_url in status.stdout and "uptime" in status.stdout and "ok" in status.stdout
        report = json.loads(mtplxd("status", "--state-dir", str(state), "--json").stdout)
        assert report["running"] and report["health"]["status"] == "ok" and "memory" in report["health"]

        again = mtplxd("start", "--model", str(model), "--state-dir", str(state), "--port", "0")
        assert again.returncode == 1 and "already running" in again.stderr
        _assert_lock_refuses_second_owner(state)

        stopped = mtplxd("stop", "--state-dir", str(state))
        assert stopped.returncode == 0 and "stopped" in stopped.stdout
        assert daemon.process.wait(10) == 0, client.log_tail(state, 30)
        assert not (state / "daemon.pid").exists() and not (state / "daemon.json").exists()

    gone = mtplxd("status", "--state-dir", str(state))
    assert gone.returncode == 3 and "not running" in gone.stdout
    assert json.loads(mtplxd("status", "--state-dir", str(state), "--json").stdout)["running"] is False
    again = mtplxd("stop", "--state-dir", str(state))
    assert again.returncode == 0 and "not running" in again.stdout

    with running_daemon(state, model) as daemon:  # restart on the same state dir
        lines, reader = _stream_in_background(daemon.base_url)
        assert stop_process(daemon.process, signal.SIGINT) == 0  # Ctrl-C
        reader.join(10)
        assert not (state / "daemon.pid").exists() and not (state / "daemon.json").exists()
    # The stream in flight ended with an error event, not a cut connection.
    events = [line for line in lines if line.startswith("data:")]
    assert len(events) >= 2 and '"error"' in events[-1] and "shutting down" in events[-1]


def _stream_in_background(base_url: str) -> tuple[list[str], threading.Thread]:
    """Start a long streamed completion; return once its first event arrived. The
    list fills up on the reader thread until the server ends the stream."""
    host, port = base_url.rsplit("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "default", "prompt": "hello", "max_tokens": 3000, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    lines: list[str] = []
    first = threading.Event()

    def read() -> None:
        for raw in response:
            lines.append(raw.decode().strip())
            first.set()
        first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(20)
    return lines, reader


def _assert_lock_refuses_second_owner(state: Path) -> None:
    """The daemon's own check (the CLI's quick one aside): the pid file's lock."""
    from mtplxd.daemon import AlreadyRunning, PidLock

    with pytest.raises(AlreadyRunning, match="already running"):
        with PidLock(state / "daemon.pid"):
            pass
    assert (state / "daemon.pid").read_text().strip().isdigit()


def test_failed_model_keeps_answering_and_sigterm_cleans_up(tmp_path):
    state, broken = tmp_path / "state", tmp_path / "not-a-model"
    broken.mkdir()
    with running_daemon(state, broken, until="failed") as daemon:
        for _ in range(2):
            code, body = client.get_json(daemon.base_url + "/health")
            assert code == 503 and body["status"] == "failed" and "config.json" in body["error"]
        assert mtplxd("status", "--state-dir", str(state)).returncode == 0
        assert stop_process(daemon.process, signal.SIGTERM) == 0
    assert not (state / "daemon.pid").exists() and not (state / "daemon.json").exists()
    assert "model failed to load" in client.log_tail(state, 50)


def test_detach_round_trip(tmp_path, model):
    state = tmp_path / "state"
    started = mtplxd("start", "--detach", "--model", str(model), "--state-dir", str(state), "--port", "0",
                     "--api-key", "sesame")
    try:
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip()
        assert url == client.daemon_url(state)
        code, body = client.get_json(url + "/health")
        assert body["status"] in ("loading", "ok")
        assert mtplxd("status", "--state-dir", str(state)).returncode == 0
        # The key reached the daemon, but not its command line (visible to every user).
        assert client.get_json(url + "/v1/models")[0] == 401
        assert client.get_json(url + "/v1/models", api_key="sesame")[0] == 200
        pid = str(client.owner_pid(state))
        args = subprocess.run(["ps", "-o", "args=", "-p", pid], capture_output=True, text=True).stdout
        assert "mtplxd" in args and "sesame" not in args

        # A second daemon on the same port fails to start: non-zero, with the log's tail.
        port = url.rsplit(":", 1)[1]
        clash = mtplxd("start", "--detach", "--model", str(model), "--state-dir", str(tmp_path / "b"),
                       "--port", port)
        assert clash.returncode != 0 and "address already in use" in clash.stderr
        assert client.owner_pid(tmp_path / "b") is None
    finally:
        stopped = mtplxd("stop", "--state-dir", str(state))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert client.owner_pid(state) is None and not (state / "daemon.json").exists()


# -- in-process: a model load the test controls ----------------------------------------


async def _until(predicate, timeout: float = 20.0):
    with anyio.fail_after(timeout):
        while not (value := predicate()):
            await anyio.sleep(0.02)
    return value


async def _health(port: int) -> tuple[int, dict]:
    return await anyio.to_thread.run_sync(client.get_json, f"http://127.0.0.1:{port}/health")


@pytest.mark.anyio
async def test_health_reports_loading_then_ok(tmp_path, model):
    from mtplxd.daemon import Daemon, load_model

    gate = threading.Event()
    daemon = Daemon(Settings(state_dir=tmp_path, port=0, model=model, calibrate_tokens=0), lambda: gate.wait(20) and load_model(model))
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.serve)
        port = await _until(lambda: daemon.port)
        assert json.loads((tmp_path / "daemon.json").read_text())["port"] == port
        code, body = await _health(port)
        assert (code, body["status"]) == (503, "loading")
        gate.set()
        await _until(lambda: daemon.scheduler.state == "ready")
        code, body = await _health(port)
        assert (code, body["status"]) == (200, "ok")
        daemon.shutdown()
    assert not (tmp_path / "daemon.pid").exists() and not (tmp_path / "daemon.json").exists()


@pytest.mark.anyio
async def test_shutdown_during_a_load_does_not_wait_for_it(tmp_path, model, monkeypatch):
    from mtplxd import daemon as daemon_module

    monkeypatch.setattr(daemon_module, "LOADER_GRACE_S", 0.2)
    gate = threading.Event()
    daemon = daemon_module.Daemon(Settings(state_dir=tmp_path, port=0, model=model, calibrate_tokens=0), lambda: gate.wait(20))
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.serve)
        await _until(lambda: daemon.port)
        daemon.shutdown()
    gate.set()  # let the abandoned loader thread finish
    assert time.monotonic() - started < 10
    assert not (tmp_path / "daemon.pid").exists() and not (tmp_path / "daemon.json").exists()
