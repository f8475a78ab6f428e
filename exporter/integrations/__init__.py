"""Engine integrations: imported only inside an engine's rank processes, never by the sidecar."""
