"""The daemon's LSP socket: `<state_dir>/lsp.sock`, 0600, one CompletionServer per connection.

    serve_lsp(scheduler, settings)   # a task of the daemon's task group; runs until cancelled

Messages are framed as the LSP says (Content-Length headers). The read loop is
ours rather than pygls' so that a request whose params do not match the LSP types
(a negative position, a missing field) is answered with a JSON-RPC error instead
of being dropped, and so that a connection ending never ends the process.
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

from adapters.lsp import CompletionServer
from mtplxd.lsp_bridge import LSP_SOCKET

log = logging.getLogger("mtplxd.lsp")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


async def serve_lsp(scheduler: Any, settings: Any) -> None:
    path = Path(settings.state_dir) / LSP_SOCKET
    # pygls logs every message it sends at INFO: document text has no place in the daemon's log.
    logging.getLogger("pygls").setLevel(logging.WARNING)
    connections: set[CompletionServer] = set()

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server = None
        try:
            server = CompletionServer(scheduler)
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
        server = await asyncio.start_unix_server(connected, path=str(path), limit=MAX_MESSAGE_BYTES)
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
            length = await _read_headers(reader)
            if length is None:
                break
            dispatch(server, await reader.readexactly(length))
            # Let a request's handler take its document snapshot before the next message
            # (perhaps an edit) is applied: a request sees the text it was sent against.
            await asyncio.sleep(0)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass


async def _read_headers(reader: asyncio.StreamReader) -> int | None:
    """The Content-Length of the next message; None at the end of the stream."""
    length = None
    while True:
        line = await reader.readline()
        if not line:
            return None
        if not line.strip():
            if length is not None:
                return length
            continue  # stray blank line between messages
        name, _, value = line.decode("ascii", "replace").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip()) if value.strip().isdigit() else None
            if length is None or length > MAX_MESSAGE_BYTES:
                raise ConnectionError(f"bad Content-Length header {line!r}")


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
