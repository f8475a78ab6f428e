"""The durable state: the file that keeps the rollups exact across restarts of the sidecar."""
