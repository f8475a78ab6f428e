"""hicache-exporter: rank-aware metrics for hierarchical KV caches of sharded LLM servers."""

__version__ = "0.1.0"
