"""The sidecar: ingest server, per-rank state, rollups and the HTTP exposition."""
