"""The llama-servers behind lpcache: the HTTP client (`llama`, and `clients` for other client plugins), a backend
with its breaker and model identity (`backend`), its slots and who holds them (`slots`, `slot_truth`), the
`/slots` save / restore / erase calls (`swap`, the only module that makes them) and router-mode models
(`router_models`)."""
