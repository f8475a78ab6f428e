"""`hicache-exporter top`: a refreshing terminal view of a sidecar's /api/v1/status.

`fetch` reads the document over HTTP (stdlib only), `view` keeps what the screen shows between
polls, `render` turns that into rich renderables and `screen` runs the refreshing loop. Only
`render` and `screen` import rich, which is the optional `top` extra: the sidecar never needs it.
"""
