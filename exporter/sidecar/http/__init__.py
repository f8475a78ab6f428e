"""The HTTP side: the aiohttp application, its middlewares (bodies, auth, TLS) and static files."""
