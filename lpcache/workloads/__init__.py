"""Traffic for tests, benchmarks and the demo, apart from the proxy (which never imports it): real-looking chats
(`chats`), agents' requests (`agents`, `agent_texts`), the story sessions workload (`story`), the soak's fault
schedule (`soak`), real processes to drive (`harness`: llama-server, lpcache) and `make demo` (`demo`)."""
