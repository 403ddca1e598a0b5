"""What the protocols share: chat turns, tool-call parsing, reasoning, streaming text, JSON output."""
