"""lpcache's parts for other proxies: `lpcache.integrations.litellm` is a LiteLLM hook for session mode."""
