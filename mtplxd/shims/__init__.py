"""Client-side programs editors and agents spawn: `mtplxd lsp` and `mtplxd mcp`."""
