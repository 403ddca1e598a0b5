"""Hostile frames on the two stdio entry points, driven the way agents and editors drive them.

- `mtplxd mcp` (the MCP stdio shim): raw lines on its stdin. A line that is not JSON gets a
  -32700 parse error with id null; JSON that is not a JSON-RPC message gets -32600 with the
  message's id when it has a usable one (else null); only JSON-RPC reaches stdout, the warning
  goes to stderr, and the next valid request (`initialize` first, then `ping` / `tools/list`)
  is answered. A line over the limit (max_body_bytes) gets -32600 and is dropped as it streams
  in, the shim's memory bounded.
- `mtplxd lsp` (the byte-for-byte bridge to the daemon's LSP socket): raw LSP frames. A
  Content-Length that is not a byte count, or none at all, loses the framing: one framed
  -32700 error (id null), then the end of the stream. A body over the daemon's limit keeps the
  framing: -32600, and the same connection goes on serving; so does a body that is not JSON,
  and a message with a header line over the limit (skipped as an oversized body is).

One real daemon (a tiny MiMo checkpoint) serves the whole module; the last two tests connect
the SDK's MCP client and pygls' LanguageClient to it, as agents and editors do.
"""

from __future__ import annotations

import json
import queue
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from adapters.lsp.transport import MAX_HEADER_LINE_BYTES, MAX_MESSAGE_BYTES
from tests.checkpoints import write
from tests.daemon_fixture import daemon_env, mtplxd_command, running_daemon, stop_process

REPLY_TIMEOUT_S = 30.0  # a first tools/list waits for the shim to connect to the daemon
EXIT_TIMEOUT_S = 15.0
PARSE_ERROR, INVALID_REQUEST = -32700, -32600
INITIALIZE = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "hostile", "version": "0"}}

NOT_JSON = [
    b"not json",
    b'{"jsonrpc": "2.0", "id": 1, "method": "ping"',  # cut short
    b'{"jsonrpc": "2.0", "id": 2, "method": "ping"} trailing',
    b"{'jsonrpc': '2.0'}",
    b"NaN",  # Python's json reads it; JSON has no such value
    b'\xff\xfe{"jsonrpc": "2.0"}',  # not UTF-8
    b"[" * 100_000 + b"]" * 100_000,  # deeper than any parser goes
]
NOT_JSON_RPC = [  # (line, the id the error must carry)
    (b"[1,2]", None),  # a batch: MCP has none
    (b"[]", None),
    (b"{}", None),
    (b'"ping"', None),
    (b"null", None),
    (b'{"id":7}', 7),  # no "jsonrpc": "2.0"
    (b'{"jsonrpc":"2.0","id":8,"method":5}', 8),
    (b'{"jsonrpc":"1.0","id":"abc","method":"ping"}', "abc"),
    (b'{"jsonrpc":"2.0","id":9,"method":"ping","params":[1]}', 9),  # MCP params are an object
    (b'{"jsonrpc":"2.0","id":10}', 10),  # neither a request nor a response
    (b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}', 1.5),
    (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', None),  # not an id: null
    (b'{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}', None),
    (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', None),  # MCP ids are never null
    (b'{"jsonrpc":"2.0","method":["tools/list"]}', None),
]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    checkpoint = write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)
    with running_daemon(tmp_path_factory.mktemp("state"), checkpoint) as daemon:
        yield daemon.state_dir


class Spawned:
    """A stdio command of ours spoken to in raw bytes; `read_one` yields what it writes,
    one message at a time (None: the end of its stdout), read on a thread so that every
    wait is bounded."""

    def __init__(self, args: list[str], cwd: Path | None = None):
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([*mtplxd_command(), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, env=daemon_env(), cwd=cwd)
        self.messages: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        try:
            while (message := self.read_one(self.process.stdout)) is not None:
                self.messages.put(message)
        finally:
            self.messages.put(None)

    def read_one(self, stdout) -> dict | None:
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def next(self, timeout: float = REPLY_TIMEOUT_S) -> dict | None:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no reply within {timeout:.0f} s; stderr:\n{self.errors()}")

    def reply(self) -> dict:
        """The next response, skipping what the server sends on its own (notifications)."""
        while True:
            message = self.next()
            assert message is not None, f"the stream ended; stderr:\n{self.errors()}"
            if "method" not in message:
                return message

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def close(self) -> int:
        """End our side (as a client does) and reap the process: its exit code."""
        try:
            self.process.stdin.close()
            return self.process.wait(EXIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return stop_process(self.process)
        finally:
            self.stderr.close()


class Shim(Spawned):
    """`mtplxd mcp`: newline-delimited JSON-RPC."""

    def read_one(self, stdout) -> dict | None:
        line = stdout.readline()
        return json.loads(line) if line else None  # anything but JSON on stdout fails the test here

    def request(self, msg_id: int, method: str, params: dict | None = None) -> dict:
        message = {"jsonrpc": "2.0", "id": msg_id, "method": method, **({"params": params} if params else {})}
        self.send(json.dumps(message).encode() + b"\n")
        reply = self.reply()
        assert reply.get("id") == msg_id and "result" in reply, reply
        return reply["result"]


class Bridge(Spawned):
    """`mtplxd lsp`: LSP frames (Content-Length headers)."""

    def read_one(self, stdout) -> dict | None:
        headers = {}
        while (line := stdout.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("ascii").partition(":")
            headers[name.strip().lower()] = value.strip()
        if not line:
            assert not headers, f"the stream ended inside headers {headers}"
            return None
        body = stdout.read(int(headers["content-length"]))  # framed like any LSP message
        assert len(body) == int(headers["content-length"])
        return json.loads(body)

    def frame(self, body: bytes) -> None:
        self.send(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def request(self, msg_id: int, method: str, params: dict | None) -> dict:
        self.frame(json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}).encode())
        reply = self.reply()
        assert reply.get("id") == msg_id and "result" in reply, reply
        return reply["result"]


def shim(state_dir: Path, cwd: Path) -> Shim:
    return Shim(["mcp", "--state-dir", str(state_dir)], cwd)


def bridge(state_dir: Path) -> Bridge:
    return Bridge(["lsp", "--state-dir", str(state_dir)])


def assert_error(reply: dict, code: int, msg_id) -> str:
    assert reply["jsonrpc"] == "2.0" and "result" not in reply, reply
    assert reply["error"]["code"] == code and reply["id"] == msg_id, reply
    return reply["error"]["message"]


def check_still_serving(client: Shim, turn: int) -> None:
    """`initialize` on the first turn, then ping and tools/list in turn."""
    if turn == 0:
        assert client.request(100, "initialize", INITIALIZE)["serverInfo"]["name"] == "mtplxd"
        client.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
    elif turn % 2:
        assert client.request(100 + turn, "ping") == {}
    else:
        assert "generate" in {tool["name"] for tool in client.request(100 + turn, "tools/list")["tools"]}


# -- MCP stdio -------------------------------------------------------------------------------


def test_mcp_stdio_answers_lines_that_are_not_json(state_dir, tmp_path):
    client = shim(state_dir, tmp_path)
    try:
        for turn, line in enumerate(NOT_JSON):
            client.send(line + b"\n")
            message = assert_error(client.reply(), PARSE_ERROR, None)
            assert message.startswith("Parse error"), (line, message)
            check_still_serving(client, turn)
        warnings = client.errors()
    finally:
        assert client.close() == 0
    assert warnings.count(str(PARSE_ERROR)) == len(NOT_JSON), warnings  # one warning a line, on stderr


def test_mcp_stdio_answers_invalid_messages_with_their_id(state_dir, tmp_path):
    client = shim(state_dir, tmp_path)
    try:
        for turn, (line, msg_id) in enumerate(NOT_JSON_RPC):
            client.send(line + b"\n")
            message = assert_error(client.reply(), INVALID_REQUEST, msg_id)
            assert message.startswith("Invalid Request"), (line, message)
            check_still_serving(client, turn)
        client.send(b"\n   \r\n")  # blank lines are no messages: nothing to answer
        check_still_serving(client, 1)
        warnings = client.errors()
    finally:
        assert client.close() == 0
    assert warnings.count(str(INVALID_REQUEST)) == len(NOT_JSON_RPC), warnings


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_mcp_stdio_answers_an_over_long_line_in_bounded_memory(state_dir, tmp_path):
    """A 256 MiB line (16 times the default limit, max_body_bytes) is answered with -32600 and
    dropped as it streams in: the shim's peak memory grows by less than 64 MiB (before: the
    line was held whole, 1,097 MiB at peak)."""
    client = shim(state_dir, tmp_path)
    try:
        for turn in range(3):  # initialized, connected to the daemon, tools listed
            check_still_serving(client, turn)
        before = peak_rss(client.process.pid)
        size = 256 * 2**20
        chunk = b"a" * 2**20
        client.send(b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"pad":"')
        for _ in range(size // len(chunk)):
            client.send(chunk)
        client.send(b'"}}\n')
        message = assert_error(client.reply(), INVALID_REQUEST, None)
        assert "over the limit of 16,777,216 bytes" in message, message
        grown = peak_rss(client.process.pid) - before
        assert grown < 64 * 2**20, f"peak memory grew by {grown / 2**20:.0f} MiB"
        for turn in range(3, 5):
            check_still_serving(client, turn)
        warnings = client.errors()
    finally:
        assert client.close() == 0
    assert "over the limit" in warnings, warnings


# -- LSP through the bridge ------------------------------------------------------------------


@pytest.mark.parametrize("frame, named", [
    (b"Content-Length: abc\r\n\r\n{}", "abc"),
    (b"Content-Length: -5\r\n\r\n", "-5"),
    (b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n\r\n{}", "Content-Length"),
    (b"X-Long: " + b"a" * 2**20 + b"\r\n\r\n{}", "over the limit"),
], ids=["non-numeric", "negative", "missing", "missing after an over-long line"])
def test_lsp_lost_framing_gets_one_parse_error_then_the_end(state_dir, frame, named):
    client = bridge(state_dir)
    try:
        client.send(frame)
        message = assert_error(client.reply(), PARSE_ERROR, None)
        assert named in message, message
        assert client.next() is None  # the daemon hung up: the bridge's stdout ends
        assert client.process.wait(EXIT_TIMEOUT_S) == 0
    finally:
        client.close()


def test_lsp_oversized_message_is_skipped_and_the_connection_kept(state_dir):
    client = bridge(state_dir)
    try:
        size = MAX_MESSAGE_BYTES + 1
        client.send(b"Content-Length: %d\r\n\r\n" % size)
        chunk = b"x" * 2**20
        for start in range(0, size, len(chunk)):  # streamed, as an editor's pipe would carry it
            client.send(chunk[:size - start])
        message = assert_error(client.reply(), INVALID_REQUEST, None)
        assert str(size) in message and str(MAX_MESSAGE_BYTES) in message, message
        result = client.request(1, "initialize", {"processId": None, "rootUri": None, "capabilities": {}})
        assert "capabilities" in result
    finally:
        client.close()


def test_lsp_over_long_header_line_is_skipped_and_the_connection_kept(state_dir):
    """An 8 MiB header line, then a Content-Length: the framing holds, so the message is
    skipped with -32600 naming the header limit, and the connection goes on."""
    client = bridge(state_dir)
    try:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}).encode()
        long_line = b"X-Long: " + b"a" * (8 * 2**20) + b"\r\n"
        client.send(long_line + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        message = assert_error(client.reply(), INVALID_REQUEST, None)
        assert "header line" in message and f"limit of {MAX_HEADER_LINE_BYTES} bytes" in message, message
        result = client.request(2, "initialize", {"processId": None, "rootUri": None, "capabilities": {}})
        assert "capabilities" in result
    finally:
        client.close()


def test_lsp_body_that_is_not_json_is_answered_and_kept(state_dir):
    client = bridge(state_dir)
    try:
        client.frame(b"{not json")
        assert_error(client.reply(), PARSE_ERROR, None)
        assert "capabilities" in client.request(1, "initialize", {"processId": None, "rootUri": None,
                                                                   "capabilities": {}})
        client.frame(b"[1,2]")
        assert_error(client.reply(), INVALID_REQUEST, None)
        assert client.request(2, "shutdown", None) is None
    finally:
        client.close()


# -- real clients afterwards -----------------------------------------------------------------


@pytest.mark.anyio
async def test_the_mcp_sdk_client_is_served_over_the_shim(state_dir, tmp_path):
    from tests.test_mcp import stdio

    async with stdio(daemon_env({"MTPLXD_HOME": str(state_dir)}), tmp_path) as session:
        assert "generate" in {tool.name for tool in (await session.list_tools()).tools}
        out = await session.call_tool("generate", {"prompt": "hi", "max_tokens": 2})
        assert not out.is_error and out.structured_content["usage"]["completion_tokens"] <= 2


@pytest.mark.anyio
async def test_pygls_client_is_served_over_the_bridge(state_dir, tmp_path):
    from tests.test_lsp import SOURCE, lsp, open_doc, texts

    async with lsp(daemon_env({"MTPLXD_HOME": str(state_dir)}), tmp_path) as (client, _):
        uri = open_doc(client, tmp_path / "f.py", SOURCE)
        assert await texts(client, uri, 1, 11)
