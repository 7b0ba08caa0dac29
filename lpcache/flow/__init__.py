"""One request's way through lpcache: who asks (`guard`), the prefilter plugins (`prefiltering`, on the interface
in `plugin_api`), the pipeline's steps (`pipeline`), a slot found and filled (`slot_fill`), the call and its
retries (`attempts`, `forwarded`), the answer relayed (`relay`) or shared with identical requests (`coalesce`),
the slot's cache saved (`saving`), and what happened, recorded (`record`)."""
