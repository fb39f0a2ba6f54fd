"""hooks: the HookRegistry service (tokens, inbox, ownership)."""
