"""The daemon's LSP socket: `<state_dir>/lsp.sock`, 0600, one CompletionServer per connection.

    serve_lsp(runtime, settings)   # a task of the daemon's task group; runs until cancelled

Messages are framed as the LSP says (Content-Length headers). The read loop is
ours rather than pygls' so that a request whose params do not match the LSP types
(a negative position, a missing field) is answered with a JSON-RPC error instead
of being dropped, and so that a connection ending never ends the process.

Hostile framing is answered in JSON-RPC's own form, framed like any other message:
a Content-Length that is not a byte count, or none at all, loses track of where the
next message starts, so one -32700 error (id null) is sent and the connection closed;
a Content-Length over MAX_MESSAGE_BYTES still says where the next message starts, so
that many bytes are skipped (never held in memory), -32600 is sent and the connection
goes on serving. A header line over MAX_HEADER_LINE_BYTES is read past the same way: with
a Content-Length among the message's other headers the framing holds, so its body is
skipped with -32600 as well; without one, the framing is lost as above.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import cattrs
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams

from adapters.lsp.server import CompletionServer
from mtplxd.config import Settings
from mtplxd.runtime import Runtime
from mtplxd.state_dir import LSP_SOCKET

log = logging.getLogger("mtplxd.lsp")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# LSP has two short headers; the stream reader's limit, so a header line is never held past it.
MAX_HEADER_LINE_BYTES = 64 * 1024
SKIP_CHUNK_BYTES = 1024 * 1024  # an oversized body is read and dropped this much at a time
MAX_COUNT_DIGITS = 18


class FramingLost(Exception):
    """The headers of a message do not say where it ends; str(e) names the bad header."""


class _LongLine(Exception):
    """A header line over MAX_HEADER_LINE_BYTES, read past; `size`: its length."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


async def serve_lsp(runtime: Runtime, settings: Settings) -> None:
    path = Path(settings.state_dir) / LSP_SOCKET
    # pygls logs every message it sends at INFO: document text has no place in the daemon's log.
    logging.getLogger("pygls").setLevel(logging.WARNING)
    connections: set[CompletionServer] = set()

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server = None
        try:
            server = CompletionServer(runtime)
            connections.add(server)
            await serve_connection(server, reader, writer)
        except Exception:
            log.exception("LSP connection failed")
        finally:
            if server is not None:
                server.close()
                connections.discard(server)
            writer.close()

    try:
        path.unlink(missing_ok=True)  # a dead daemon's socket: the state dir's lock is ours now
        server = await asyncio.start_unix_server(connected, path=str(path), limit=MAX_HEADER_LINE_BYTES)
        os.chmod(path, 0o600)
    except OSError as e:
        log.error("cannot serve LSP on %s: %s; editors cannot connect", path, e)
        return
    log.info("LSP on %s", path)
    try:
        await server.serve_forever()
    finally:
        server.close()
        for connection in list(connections):
            connection.close()
        path.unlink(missing_ok=True)


async def serve_connection(server: CompletionServer, reader: asyncio.StreamReader, writer: Any) -> None:
    server.protocol.set_writer(writer)
    try:
        while not server.closed:
            try:
                headers = await _read_headers(reader)
            except FramingLost as e:
                log.warning("LSP: %s; closing the connection", e)
                _error(server, None, -32700, f"Parse error: {e}; closing the connection")
                break  # the transport sends what it holds before it closes
            if headers is None:
                break
            length, refusal = headers
            if refusal is None and length > MAX_MESSAGE_BYTES:
                refusal = f"a message of {length} bytes is over the limit of {MAX_MESSAGE_BYTES} bytes"
            if refusal is not None:
                await _skip(server, reader, length, refusal)
                continue
            dispatch(server, await reader.readexactly(length))
            # Let a request's handler take its document snapshot before the next message
            # (perhaps an edit) is applied: a request sees the text it was sent against.
            await asyncio.sleep(0)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass


async def _read_headers(reader: asyncio.StreamReader) -> tuple[int, str | None] | None:
    """(the Content-Length of the next message, perhaps over MAX_MESSAGE_BYTES; why its body
    must be skipped, or None); None at the end of the stream. FramingLost when the length is
    not a byte count, or the headers have none."""
    length = None
    headers = False  # a header line of this message was read
    refusal = None
    while True:
        try:
            line = await _read_line(reader)
        except _LongLine as e:
            refusal = f"a header line of {e.size} bytes is over the limit of {MAX_HEADER_LINE_BYTES} bytes"
            headers = True
            continue
        if not line:
            return None
        if not line.strip():
            if length is not None:
                return length, refusal
            if headers:
                raise FramingLost(f"headers without a Content-Length header ({refusal or 'none sent'})")
            continue  # stray blank line between messages
        headers = True
        name, _, value = line.decode("ascii", "replace").partition(":")
        if name.strip().lower() == "content-length":
            count = value.strip()
            # More digits than any stream carries bytes: int() would refuse the longest ones.
            if not count.isdigit() or len(count) > MAX_COUNT_DIGITS:
                shown = line.decode("ascii", "replace").strip()[:80]
                raise FramingLost(f"bad header {shown!r}: Content-Length must be a byte count")
            length = int(count)


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    """The next header line (b"" at the end of the stream); _LongLine, once it has been read
    past, for one over the reader's limit (MAX_HEADER_LINE_BYTES)."""
    size = 0
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            return e.partial if not size else b""  # the stream ended inside the line
        except asyncio.LimitOverrunError as e:
            # No newline within the limit: drop what the reader holds and look further.
            size += len(await reader.readexactly(e.consumed))
            continue
        if size:
            raise _LongLine(size + len(line.rstrip(b"\r\n")))
        return line


async def _skip(server: CompletionServer, reader: asyncio.StreamReader, length: int, refusal: str) -> None:
    """Drop a refused body a chunk at a time (the framing still holds), then say why."""
    left = length
    while left > 0:
        chunk = await reader.read(min(left, SKIP_CHUNK_BYTES))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(chunk)
    log.warning("LSP: skipped a message: %s", refusal)
    _error(server, None, -32600, f"Invalid Request: {refusal}")


def dispatch(server: CompletionServer, body: bytes) -> None:
    protocol = server.protocol
    try:
        data = json.loads(body)
    except ValueError as e:
        _error(server, None, -32700, f"Parse error: {e}")
        return
    if not isinstance(data, dict) or data.get("jsonrpc") != "2.0":
        _error(server, data.get("id") if isinstance(data, dict) else None, -32600,
               "Invalid Request: expected a JSON-RPC 2.0 object")
        return
    try:
        message = _structure(protocol, data)
    except (cattrs.BaseValidationError, JsonRpcException, ValueError, TypeError, KeyError) as e:
        method = data.get("method")
        if "id" in data and method is not None:
            detail = "; ".join(cattrs.transform_error(e)) if isinstance(e, cattrs.BaseValidationError) else str(e)
            _error(server, data["id"], JsonRpcInvalidParams.CODE, f"Invalid params for {method}: {detail}")
        else:
            log.warning("LSP: dropped a malformed message (%s)", method or "no method")
        return
    try:
        protocol.handle_message(message)
    except Exception:
        log.exception("LSP: failed to handle %s", data.get("method"))
        if "id" in data and "method" in data:
            _error(server, data["id"], -32603, "Internal error")


def _structure(protocol: Any, data: dict) -> Any:
    """A request or notification as its LSP type (raising on params that do not fit it);
    anything else as pygls reads it."""
    message_type = protocol.get_message_type(data["method"]) if "method" in data else None
    if message_type is None:
        return protocol.structure_message(data)
    return protocol._converter.structure(data, message_type)


def _error(server: CompletionServer, msg_id: Any, code: int, message: str) -> None:
    server.protocol._send_data({"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}})
