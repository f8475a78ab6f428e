"""The proxy source: an engine's own /metrics or multiprocess directory, read and fed to the core."""
