"""What the sidecar shows: its families, the collector, the text renderer, the status document and page."""
