"""Other client APIs served through llama-server's chat completions, converted exactly as llama-server does."""
