"""The push source: the Unix socket listener, its socket file and its peers' credentials."""
