"""The LSP server on the daemon's socket: documents, inline completions, framing."""
