"""The MCP server (Streamable HTTP at /mcp): its tools, resources, prompts and path rules."""
