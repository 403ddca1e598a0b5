"""The stdio transport of `mtplxd mcp`: newline-delimited JSON-RPC on this process's stdin/stdout.

    async with stdio_transport(max_line_bytes) as (read, write):
        await server.run(read, write, server.create_initialization_options())

It gives the MCP SDK's low-level `Server` what the SDK's own stdio transport gives it (a
stream of `SessionMessage`s in, a stream of `SessionMessage`s out), and differs in one way:
a line that is not a JSON-RPC message is answered on the wire, as JSON-RPC 2.0 says, rather
than handed to the server as an exception that it only logs at debug level (the agent would
wait forever for a reply):

- a line that is not JSON (nor UTF-8): -32700, id null;
- JSON that is not a JSON-RPC 2.0 message (a batch, no "jsonrpc": "2.0", a method that is
  not a string...): -32600, with the message's id when it is a string or a number, else null.

- a line over `max_line_bytes` (the daemon's `max_body_bytes`: a longer message could not be
  relayed to `/mcp` anyway): -32600, id null (the id is in the part never read). The line is
  read and dropped a chunk at a time, so it never sits in memory whole.

Either way a warning goes to stderr and the next line is served as usual. Blank lines are
skipped: they carry no message to answer.

Only JSON-RPC goes to stdout: while serving, fd 0 reads the null device and fd 1 writes to
stderr, so that a stray print (ours, a library's, a child's) cannot corrupt the wire; the
transport uses private duplicates of the two descriptors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, AsyncIterator, BinaryIO, Iterator

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from mcp.shared.message import SessionMessage
from mcp_types import INVALID_REQUEST, PARSE_ERROR, JSONRPCNotification, jsonrpc_message_adapter

log = logging.getLogger("mtplxd.mcp")

SHOWN_CHARS = 120  # of a bad line, in the warning
SKIP_CHUNK_BYTES = 1 << 20  # an over-long line is read and dropped this much at a time


@dataclass(frozen=True)
class LineTooLong:
    """What the reader hands on instead of a line over the limit: its length."""

    size: int
    limit: int


@asynccontextmanager
async def stdio_transport(max_line_bytes: int) -> AsyncIterator[tuple[Any, Any]]:
    """(read, write) streams for `Server.run`, served on stdin/stdout until stdin ends;
    a line longer than `max_line_bytes` (its newline aside) is answered, never held."""
    with _claimed_stdio() as (wire_in, wire_out):
        wire = _Wire(wire_out)
        to_server, read = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        write, from_server = anyio.create_memory_object_stream[SessionMessage](0)
        lines_in, lines = anyio.create_memory_object_stream[bytes | LineTooLong](0)
        _start_reader(wire_in, lines_in, max_line_bytes)
        with lines:  # closed at the end: the reader thread stops at its next line
            async with anyio.create_task_group() as reading:
                reading.start_soon(_serve_lines, lines, to_server, wire)
                async with anyio.create_task_group() as writing:
                    writing.start_soon(_write_messages, from_server, wire)
                    try:
                        yield read, write
                    finally:
                        write.close()  # the server is done: the writer ends once its last reply is out
                reading.cancel_scope.cancel()  # the server may end before stdin does


class _Wire:
    """The private stdout: one line at a time, whoever writes (server replies, our errors)."""

    def __init__(self, out: BinaryIO):
        self.out = out
        self.lock = anyio.Lock()
        self.broken = False

    async def send(self, text: str) -> None:
        async with self.lock:
            if self.broken:
                return
            try:
                await anyio.to_thread.run_sync(self._write, (text + "\n").encode())
            except OSError as e:
                # The agent is gone; keep taking the server's messages so that it never blocks
                # on a send, and let stdin's end stop everything.
                self.broken = True
                log.warning("cannot write to stdout (%s); dropping replies", e)

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()


def _start_reader(wire_in: BinaryIO, lines_in: Any, max_line_bytes: int) -> None:
    """Read stdin on a daemon thread (not one of anyio's worker threads): a read still
    blocked when serving ends must not keep the process alive."""
    token = anyio.lowlevel.current_token()

    def read() -> None:
        try:
            while line := read_line(wire_in, max_line_bytes):
                anyio.from_thread.run(lines_in.send, line, token=token)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, RuntimeError, OSError):
            pass  # serving ended first, the event loop is gone, or stdin failed: no more lines
        finally:
            with suppress(RuntimeError):  # the event loop is gone
                anyio.from_thread.run_sync(lines_in.close, token=token)  # the end of the input

    threading.Thread(target=read, name="mtplxd-mcp-stdin", daemon=True).start()


def read_line(wire_in: BinaryIO, max_line_bytes: int) -> bytes | LineTooLong:
    """The next line (b"" at the end of the input), or, for a line over the limit, its
    length once it has been read past and dropped."""
    line = wire_in.readline(max_line_bytes + 1)
    if len(line) <= max_line_bytes or line.endswith(b"\n"):
        return line
    size = len(line)
    del line  # never more than one limit's worth held
    while (chunk := wire_in.readline(SKIP_CHUNK_BYTES)) and not chunk.endswith(b"\n"):
        size += len(chunk)
    return LineTooLong(size + len(chunk.rstrip(b"\r\n")), max_line_bytes)


async def _serve_lines(lines: Any, to_server: Any, wire: _Wire) -> None:
    """Hand each valid message to the server; answer the others ourselves."""
    async with to_server:
        async for line in lines:
            if isinstance(line, LineTooLong):
                log.warning("stdin: a line of %d bytes, over the limit of %d; answered with error %d",
                            line.size, line.limit, INVALID_REQUEST)
                await wire.send(json.dumps(_error(None, INVALID_REQUEST, _too_long(line))))
                continue
            if not line.strip():
                continue
            message, error = _parse(line)
            if error is None:
                await to_server.send(SessionMessage(message))
            else:
                log.warning("stdin: %s; answered with error %d: %s", error["error"]["message"],
                            error["error"]["code"], _shown(line))
                await wire.send(json.dumps(error))


async def _write_messages(from_server: Any, wire: _Wire) -> None:
    async with from_server:
        async for session_message in from_server:
            await wire.send(session_message.message.model_dump_json(by_alias=True, exclude_unset=True))


# -- one line --------------------------------------------------------------------------------


def _parse(line: bytes) -> tuple[Any, dict | None]:
    """(the JSON-RPC message, None), or (None, the error reply to write instead)."""
    try:
        data = json.loads(line.decode("utf-8"), parse_constant=_no_constant)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        return None, _error(None, PARSE_ERROR, f"Parse error: {e}")
    except RecursionError:
        return None, _error(None, PARSE_ERROR, "Parse error: nesting too deep")
    try:
        message = jsonrpc_message_adapter.validate_python(data)
    except ValueError:  # pydantic's ValidationError
        return None, _error(_usable_id(data), INVALID_REQUEST, f"Invalid Request: {_why_invalid(data)}")
    if isinstance(message, JSONRPCNotification) and "id" in data:
        # The SDK reads a request whose id is unusable as a notification (extra fields are
        # ignored), which would leave the agent waiting: MCP ids are strings or integers.
        return None, _error(_usable_id(data), INVALID_REQUEST, 'Invalid Request: "id" must be a string or an integer')
    return message, None


def _too_long(line: LineTooLong) -> str:
    return (f"Invalid Request: a line of {line.size:,} bytes is over the limit of {line.limit:,} bytes "
            "(the max_body_bytes setting); it was dropped")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json would read NaN and Infinity


def _usable_id(data: Any) -> Any:
    """The id to answer with: a string or a (finite) number; anything else gets null."""
    msg_id = data.get("id") if isinstance(data, dict) else None
    if isinstance(msg_id, bool) or not isinstance(msg_id, (str, int, float)):
        return None
    return msg_id if not isinstance(msg_id, float) or math.isfinite(msg_id) else None


def _why_invalid(data: Any) -> str:
    """The commonest faults by name; the rest in one sentence (pydantic's are long)."""
    if isinstance(data, list):
        return "a JSON array (batches are not part of MCP); expected one JSON-RPC 2.0 object"
    if not isinstance(data, dict):
        return f"a JSON {_JSON_NAMES.get(type(data), 'value')}; expected a JSON-RPC 2.0 object"
    if data.get("jsonrpc") != "2.0":
        return 'expected "jsonrpc": "2.0"'
    if "method" in data and not isinstance(data["method"], str):
        return '"method" must be a string'
    if "method" in data and not isinstance(data.get("params", {}), dict):
        return '"params" must be an object'
    return "not a JSON-RPC 2.0 request, notification or response"


_JSON_NAMES = {str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _error(msg_id: Any, code: int, message: str) -> dict:
    return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}


def _shown(line: bytes) -> str:
    text = repr(line.rstrip(b"\r\n"))
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


# -- the descriptors -------------------------------------------------------------------------


@contextmanager
def _claimed_stdio() -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """Private files on the wire (fd 0 and 1 as they were), with fd 0 and 1 pointed away
    meanwhile; restored on exit."""
    try:
        wire_in, wire_out = os.dup(0), os.dup(1)
    except OSError:  # no stdin or stdout to move: serve them in place
        wire_in, wire_out = 0, 1
    moved = (wire_in, wire_out) != (0, 1)
    if moved:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
    # closefd=False, and wire_in is never closed: the reader thread may still be blocked in a
    # read of it, and a descriptor closed under it could be recycled for another file.
    reader = os.fdopen(wire_in, "rb", closefd=False)
    writer = os.fdopen(wire_out, "wb", closefd=False)
    try:
        yield reader, writer
    finally:
        if moved:
            os.dup2(wire_in, 0)
            os.dup2(wire_out, 1)
            os.close(wire_out)
