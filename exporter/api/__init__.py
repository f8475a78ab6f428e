"""The sidecar's JSON API as typed models, shared by the sidecar that writes it and the clients that read it."""
