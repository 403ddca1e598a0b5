"""Headless Neovim with the shipped config (examples/editors/neovim/mtplxd.lua) gets a suggestion.

Neovim spawns `mtplxd lsp` itself (found on PATH, as users install it), which starts a
daemon on the embedded model in a temporary state dir. Each path runs on the versions that
take it: Neovim 0.12+ declares inline completion and the server offers it; older ones
(Debian's 0.7, which CI installs) get the plain `textDocument/completion`. Skipped where
`nvim` is not installed, or older than 0.7 (the config's oldest).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtplxd import client as daemon_client
from tests.daemon_fixture import daemon_env

NVIM = shutil.which("nvim")


def _version(nvim: str) -> tuple[int, ...]:
    first = subprocess.run([nvim, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    return tuple(int(part) for part in first.split("v")[-1].split("-")[0].split(".")[:2])  # "NVIM v0.11.2"

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "editors" / "neovim" / "mtplxd.lua"

# After the example config: wait for the client, ask at the cursor of `return `, write the answer.
ASK = """
vim.cmd('filetype on')
dofile(vim.env.MTPLXD_EXAMPLE)
local function mtplxd_client()  -- get_clients is 0.10+, get_active_clients before
  for _, c in ipairs((vim.lsp.get_clients or vim.lsp.get_active_clients)()) do
    if c.name == 'mtplxd' and vim.lsp.buf_is_attached(0, c.id) then return c end
  end
end
vim.api.nvim_create_autocmd('VimEnter', { callback = function()
  local out = vim.env.MTPLXD_ANSWER
  if not vim.wait(60000, function() return mtplxd_client() ~= nil end, 50) then
    vim.fn.writefile({ vim.json.encode({ error = 'no mtplxd client attached' }) }, out)
    return vim.cmd('qa!')
  end
  local client = mtplxd_client()
  local inline = (client.server_capabilities or {}).inlineCompletionProvider ~= nil
  local method = inline and 'textDocument/inlineCompletion' or 'textDocument/completion'
  local params = { textDocument = { uri = vim.uri_from_bufnr(0) }, position = { line = 1, character = 11 } }
  if inline then params.context = { triggerKind = 1 } end
  local answers, err = vim.lsp.buf_request_sync(0, method, params, 60000)
  local answer = answers and answers[client.id] or {}
  local item = answer.result and answer.result.items and answer.result.items[1]
  local text = item and (item.insertText or (item.textEdit and item.textEdit.newText))
  local failure = err or answer.err or answer.error  -- `error` before 0.8
  vim.fn.writefile({ vim.json.encode({ method = method, text = text, error = failure }) }, out)
  vim.cmd('qa!')
end })
"""


COMPLETION, INLINE = "textDocument/completion", "textDocument/inlineCompletion"
INLINE_SINCE = (0, 12)  # the first Neovim with vim.lsp.inline_completion


@pytest.mark.skipif(NVIM is None, reason="nvim is not on PATH (Neovim is not installed)")
@pytest.mark.parametrize("method", [COMPLETION, INLINE], ids=["plain completion", "inline completion"])
def test_headless_neovim_gets_a_suggestion(tmp_path, method):
    assert NVIM is not None
    version = _version(NVIM)
    if version < (0, 7):
        pytest.skip("the example config needs Neovim 0.7 or newer (nvim_create_autocmd)")
    if method == INLINE and version < INLINE_SINCE:
        pytest.skip(f"Neovim {version[0]}.{version[1]} has no inline completion (0.12+); the plain path covers it")
    if method == COMPLETION and version >= INLINE_SINCE:
        pytest.skip(f"Neovim {version[0]}.{version[1]} declares inline completion: the server offers that instead")
    workspace, state = tmp_path / "ws", tmp_path / "state"
    workspace.mkdir()
    (workspace / "pyproject.toml").write_text("")  # a root marker the config looks for
    source = workspace / "m.py"
    source.write_text("def add(a, b):\n    return \n")
    (tmp_path / "init.lua").write_text(ASK)
    env = daemon_env({
        "MTPLXD_HOME": str(state), "MTPLXD_PORT": "0", "MTPLXD_EXAMPLE": str(EXAMPLE),
        "MTPLXD_ANSWER": str(tmp_path / "answer.json"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # mtplxd
        "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_STATE_HOME": str(tmp_path / "nvim-state"),
    })
    try:
        subprocess.run([NVIM, "--headless", "-i", "NONE", "-u", str(tmp_path / "init.lua"), str(source)],
                       cwd=workspace, env=env, timeout=150, stdin=subprocess.DEVNULL, capture_output=True)
    finally:
        daemon_client.stop(state)
    answer = json.loads((tmp_path / "answer.json").read_text())
    assert answer.get("text"), answer
    assert answer["method"] == method, answer
