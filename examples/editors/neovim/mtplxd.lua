-- mtplxd completions in Neovim: copy to ~/.config/nvim/plugin/mtplxd.lua (or `:luafile` it).
--
-- Neovim 0.12+: inline completion (ghost text); <Tab> accepts, <M-]> / <M-[> cycle.
-- Neovim 0.11:  the plain completion path (`vim.lsp.completion`, popup menu), auto-triggered
--               after . ( [ { , : = and space; <C-x><C-o> asks at any time.
-- Neovim 0.7-0.10: the same server through `vim.lsp.start` (0.7: `vim.lsp.start_client`)
--               and the omnifunc (<C-x><C-o>).
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
  local markers = { '.git', 'pyproject.toml', 'package.json' }

  local function root_of(name) -- vim.fs is 0.8+; findfile/finddir search upward with ';'
    local dir = vim.fn.fnamemodify(name, ':p:h')
    if vim.fs then
      local marker = vim.fs.find(markers, { upward = true, path = dir })[1]
      return marker and vim.fs.dirname(marker) or vim.fn.getcwd()
    end
    for _, marker in ipairs(markers) do
      local found = marker == '.git' and vim.fn.finddir(marker, dir .. ';') or vim.fn.findfile(marker, dir .. ';')
      if found ~= '' then
        return vim.fn.fnamemodify(found, ':p'):gsub('/$', ''):match('^(.*)/[^/]*$')
      end
    end
    return vim.fn.getcwd()
  end

  local clients = {} -- 0.7: one client per root, attached to each of its buffers
  local function start(bufnr, config)
    if vim.lsp.start then
      return vim.lsp.start(config) -- reuses the client of the same name and root
    end
    local id = clients[config.root_dir]
    if id == nil or vim.lsp.client_is_stopped(id) then
      id = vim.lsp.start_client(config)
      clients[config.root_dir] = id
    end
    vim.lsp.buf_attach_client(bufnr, id)
  end

  vim.api.nvim_create_autocmd('FileType', {
    group = vim.api.nvim_create_augroup('mtplxd', { clear = true }),
    callback = function(args)
      if vim.bo[args.buf].buftype ~= '' then
        return
      end
      start(args.buf, {
        name = 'mtplxd',
        cmd = cmd,
        root_dir = root_of(vim.api.nvim_buf_get_name(args.buf)),
        init_options = init_options,
        on_attach = on_attach,
      })
    end,
  })
end
