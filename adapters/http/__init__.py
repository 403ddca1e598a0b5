"""The HTTP app: OpenAI- and Anthropic-style APIs, sessions, health, metrics, and its guards."""
