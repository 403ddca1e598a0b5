-- mtplxd completions in Neovim: copy to ~/.config/nvim/plugin/mtplxd.lua (or `:luafile` it).
--
-- Neovim 0.12+: inline completion (ghost text); <Tab> accepts, <M-]> / <M-[> cycle.
-- Neovim 0.11:  the plain completion path (`vim.lsp.completion`, popup menu), auto-triggered
--               after . ( [ { , : = and space; <C-x><C-o> asks at any time.
-- Neovim 0.8-0.10: the same server through `vim.lsp.start` and the omnifunc (<C-x><C-o>).
--
-- The server picks what it offers from the client's capabilities: inline completion when
-- Neovim declares it, else `textDocument/completion`. `mtplxd lsp` starts the daemon if none
-- runs; every Neovim (and every other editor) shares it.

local cmd = { 'mtplxd', 'lsp' } -- add '--model', '/path/to/checkpoint' to choose the model
local init_options = {
  mtplxd = {
    maxTokens = 64, -- new tokens per suggestion
    debounceMs = 120, -- automatic requests wait this long for the next keystroke
    contextTokens = 1024, -- prefix + suffix of the current file (70/30)
    workspaceContextTokens = 512, -- other open files of the same workspace
  },
}

local function on_attach(client, bufnr)
  if vim.lsp.inline_completion and client:supports_method('textDocument/inlineCompletion', bufnr) then
    vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
    vim.keymap.set('i', '<Tab>', function()
      if not vim.lsp.inline_completion.get() then
        return '<Tab>'
      end
    end, { expr = true, replace_keycodes = true, buffer = bufnr, desc = 'mtplxd: accept the suggestion' })
    vim.keymap.set('i', '<M-]>', function()
      vim.lsp.inline_completion.select({ count = 1 })
    end, { buffer = bufnr, desc = 'mtplxd: next suggestion' })
    vim.keymap.set('i', '<M-[>', function()
      vim.lsp.inline_completion.select({ count = -1 })
    end, { buffer = bufnr, desc = 'mtplxd: previous suggestion' })
  elseif vim.lsp.completion then
    vim.lsp.completion.enable(true, client.id, bufnr, { autotrigger = true })
  else
    vim.bo[bufnr].omnifunc = 'v:lua.vim.lsp.omnifunc'
  end
end

if vim.fn.has('nvim-0.11') == 1 then
  vim.lsp.config('mtplxd', {
    cmd = cmd,
    root_markers = { '.git', 'pyproject.toml', 'package.json', 'Cargo.toml', 'go.mod' },
    init_options = init_options,
    -- settings pushed with workspace/didChangeConfiguration; `enable = false` pauses it
    settings = init_options,
    on_attach = on_attach,
  })
  vim.lsp.enable('mtplxd')
else
  vim.api.nvim_create_autocmd('FileType', {
    group = vim.api.nvim_create_augroup('mtplxd', { clear = true }),
    callback = function(args)
      if vim.bo[args.buf].buftype ~= '' then
        return
      end
      local name = vim.api.nvim_buf_get_name(args.buf)
      local marker = vim.fs.find({ '.git', 'pyproject.toml', 'package.json' }, { upward = true, path = vim.fs.dirname(name) })[1]
      vim.lsp.start({
        name = 'mtplxd',
        cmd = cmd,
        root_dir = marker and vim.fs.dirname(marker) or vim.fn.getcwd(),
        init_options = init_options,
        on_attach = on_attach,
      })
    end,
  })
end
