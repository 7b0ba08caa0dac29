"""What lpcache knows of saved caches: a prompt's identity and block hashes (`identity`, `prefix`), the index of
cache files (`index`), their files and byte limits (`cache_files`, `eviction`), sessions and their ids
(`sessions`, `session_ids`), what a slot or the server's RAM still holds (`reuse`, `server_cache`), and what a
token costs here (`speeds`, `worth`). Pure bookkeeping: it calls no server."""
