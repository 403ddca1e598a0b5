# Point Claude Code at the local daemon (Anthropic Messages API on the daemon's port).
#   mtplxd start --detach            # or: mtplxd start --api-key "$MTPLXD_API_KEY" --detach
#   source examples/agents/claude-code/env.sh && claude
export ANTHROPIC_BASE_URL="http://127.0.0.1:8765"
# Sent as `Authorization: Bearer ...`; the daemon also takes `x-api-key` (ANTHROPIC_API_KEY).
# Any value works when the daemon runs without --api-key.
export ANTHROPIC_AUTH_TOKEN="${MTPLXD_API_KEY:-unused}"
# The daemon serves one model and answers to its id or "default"; Claude Code asks for
# several model tiers (the main model, a small fast one for titles and summaries).
export ANTHROPIC_MODEL="default"
export ANTHROPIC_DEFAULT_OPUS_MODEL="default"
export ANTHROPIC_DEFAULT_SONNET_MODEL="default"
export ANTHROPIC_DEFAULT_HAIKU_MODEL="default"
export ANTHROPIC_SMALL_FAST_MODEL="default"   # older Claude Code versions
# Local models have small contexts; the daemon lowers max_tokens to fit anyway.
export CLAUDE_CODE_MAX_OUTPUT_TOKENS="4096"
# No telemetry or update checks against Anthropic's servers.
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1"
