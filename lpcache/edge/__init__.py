"""The HTTP edge: the ASGI app and its routes (`app`), the command line (`cli`), the HTTP server's limits (`http`),
the dashboard's browser login (`browser_login`), `/metrics` (`metrics`) and the configuration page's generator
(`config_page`). The top layer: it builds everything below from the settings and hands each request to the flow."""
