"""A small but real per-rank hierarchical KV cache (HiCache): device ⇄ host ⇄ storage pages in torch."""

from cache_core.geometry import ModelGeometry, ShardGeometry
from cache_core.parallel import ParallelState

__all__ = ["ModelGeometry", "ShardGeometry", "ParallelState"]
