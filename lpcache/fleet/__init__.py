"""Several lpcache replicas through Redis: slot leases (`leases`), the shared map of index entries, sessions and
speeds (`shared_map`), and the replica that joins them (`replica`)."""
