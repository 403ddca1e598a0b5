"""The MCP resources (`mtplxd://model`, `mtplxd://metrics`, the template
`mtplxd://sessions/{workspace}`) and prompts (explain_selection, write_docstring,
commit_message). Resources read the daemon's figures (adapters/mcp/figures.py);
prompts are text templates filled in from their arguments.
"""

from __future__ import annotations

import json

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.mcpserver.resources import ResourceSecurity
from mcp.types import InputRequiredResult

from adapters.mcp.figures import Figures
from adapters.mcp.paths import guard_of


def register_resources(server: MCPServer, figures: Figures) -> None:
    @server.resource("mtplxd://model", name="model", title="Loaded model", mime_type="application/json",
                     description="the loaded model: family, MTP heads, depth range, context, sampler defaults")
    def model_resource() -> str:
        return json.dumps(figures.model_card(), indent=2)

    @server.resource("mtplxd://metrics", name="metrics", title="Daemon metrics",
                     mime_type="text/plain; version=0.0.4",
                     description="Prometheus text: requests, queue depth, TTFT, decode tok/s, MTP acceptance")
    def metrics_resource() -> str:
        return figures.metrics_text()

    @server.resource("mtplxd://sessions/{workspace}", name="sessions", title="Workspace sessions",
                     mime_type="application/json",
                     description=("one workspace the tools may use (its absolute path, percent-encoded): its "
                                  "jobs, prompt / cached / generated tokens, session-bank entries, hits and misses"),
                     security=ResourceSecurity(exempt_params={"workspace"}))  # an absolute path by design
    async def sessions_resource(workspace: str, ctx: Context) -> str | InputRequiredResult:
        # Only a folder a tool call of this client could use (adapters/mcp/paths.py): the
        # figures of any other would tell which folders exist and what was worked on in them.
        try:
            folder = await guard_of(ctx).use_in_read(workspace, ctx)
        except ToolError as e:
            raise ResourceError(f"{e} (the workspace is percent-encoded in the URI)") from None
        if isinstance(folder, InputRequiredResult):  # the client's roots first
            return folder
        return json.dumps(figures.workspace_figures(folder.id), indent=2)


def register_prompts(server: MCPServer) -> None:
    @server.prompt(title="Explain selection", description="explain what a piece of code does")
    def explain_selection(code: str, language: str = "", question: str = "") -> str:
        lang = f" {language}" if language else ""
        ask = question or "What does it do, how, and what should a reader watch out for?"
        return f"Explain this{lang} code to a developer who is new to it.\n{ask}\n\n```{language}\n{code}\n```"

    @server.prompt(title="Write docstring", description="write the docstring of a function, class or module")
    def write_docstring(code: str, language: str = "", style: str = "") -> str:
        lang = f" {language}" if language else ""
        conv = f" in the {style} style" if style else " in the language's usual style"
        return (f"Write the docstring for this{lang} code{conv}: what it does, its arguments, what it returns "
                f"and raises. Reply with the docstring only.\n\n```{language}\n{code}\n```")

    @server.prompt(title="Commit message", description="write a commit message for a diff")
    def commit_message(diff: str, convention: str = "") -> str:
        conv = f", following {convention}" if convention else ""
        return (f"Write a commit message for this diff{conv}: a summary line of at most 72 characters, a "
                f"blank line, then what changed and why. Reply with the message only.\n\n```diff\n{diff}\n```")
