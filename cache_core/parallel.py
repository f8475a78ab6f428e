"""Where a rank sits in the attention dp/cp/tp and pp layout, and the label sets that follow from it.

The engine (sglang 0.5.23) labels one rank process's series three ways, one label set per
collector; cache_core pushes each set over a connection of its own (see `cache_core.rank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.labels import radix_cache_metric_labels


@dataclass(frozen=True)
class ParallelState:
    """The parallel ranks of one scheduler process, named as the upstream engine names them.

    The tp ranks of a pipeline stage are laid out (attention dp, attention cp, attention tp),
    attention tp changing fastest (runtime_context.py derive_attention_ranks):
    tp_rank = (attn_dp_rank * attn_cp_size + attn_cp_rank) * attn_tp_size + attn_tp_rank,
    tp_size = dp_size * attn_cp_size * attn_tp_size.
    """

    tp_rank: int
    pp_rank: int
    attn_tp_rank: int
    attn_dp_rank: int
    tp_size: int
    pp_size: int
    attn_tp_size: int
    dp_size: int
    attn_cp_rank: int = 0
    attn_cp_size: int = 1

    @classmethod
    def from_layout(
        cls, attn_tp_rank: int, pp_rank: int, dp_rank: int, attn_tp_size: int, pp_size: int, dp_size: int,
        attn_cp_rank: int = 0, attn_cp_size: int = 1,
    ) -> ParallelState:
        """The state of the rank at (attention tp rank, pp rank, dp group, attention cp rank) of a layout."""
        for name, rank, size in (("tp", attn_tp_rank, attn_tp_size), ("pp", pp_rank, pp_size),
                                 ("dp", dp_rank, dp_size), ("cp", attn_cp_rank, attn_cp_size)):
            if not 0 <= rank < size:
                raise ValueError(f"{name} rank {rank} is outside 0..{size - 1}")
        return cls(
            tp_rank=(dp_rank * attn_cp_size + attn_cp_rank) * attn_tp_size + attn_tp_rank,
            pp_rank=pp_rank,
            attn_tp_rank=attn_tp_rank,
            attn_dp_rank=dp_rank,
            tp_size=attn_tp_size * attn_cp_size * dp_size,
            pp_size=pp_size,
            attn_tp_size=attn_tp_size,
            dp_size=dp_size,
            attn_cp_rank=attn_cp_rank,
            attn_cp_size=attn_cp_size,
        )

    @property
    def dp_attention(self) -> bool:
        return self.dp_size > 1

    @property
    def server_world(self) -> dict[str, int]:
        """The whole server's layout (exporter.protocol.messages.World), the same from every collector of
        every rank, as the engine hook sends it: the engine's tp size, the dp and pp sizes, the attention sizes."""
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "dp_size": self.dp_size,
                "attn_tp_size": self.attn_tp_size, "attn_cp_size": self.attn_cp_size}

    @property
    def is_stats_logging_rank(self) -> bool:
        """Ranks whose scheduler logs statistics (metrics_collector.py:1361-1363)."""
        return self.attn_tp_rank == 0 and self.attn_cp_rank == 0

    @property
    def cache_tp(self) -> tuple[int, int]:
        """(tp rank, tp size) that the cache and storage configs use (cache_controller.py:756-763)."""
        if self.dp_attention:
            return self.attn_tp_rank, self.attn_tp_size
        return self.tp_rank, self.tp_size

    def metric_labels(self, cache_type: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upstream radix-cache rank labels for this rank, with operator labels merged on top."""
        labels = radix_cache_metric_labels(cache_type, self, self.dp_attention)
        labels.update(extra or {})
        return labels

    def radix_labels(self, cache_type: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The radix collector's labels, plus `attn_cp_rank` where the engine's would collide.

        With DP attention the radix labels carry the attention tp rank and no cp rank, so the
        context-parallel peers of a group share one label set (the engine's multiprocess registry
        then sums them). One label set per connection needs them apart: they add `attn_cp_rank`
        there, and only there.
        """
        labels = self.metric_labels(cache_type, extra)
        if self.dp_attention and self.attn_cp_size > 1:
            labels["attn_cp_rank"] = self.attn_cp_rank
        return labels

    def storage_labels(self, storage_backend: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The storage collector's labels (unified_cache/storage_attachment.py:324-333)."""
        tp_rank, _ = self.cache_tp
        labels: dict[str, Any] = {
            "storage_backend": storage_backend,
            "tp_rank": tp_rank,
            "dp_rank": self.attn_dp_rank if self.dp_attention else 0,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "attn_cp_rank": self.attn_cp_rank,
            "attn_cp_size": self.attn_cp_size,
        }
        labels.update(extra or {})
        return labels

    def scheduler_labels(
        self, model_name: str, engine_type: str = "unified", extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The scheduler collector's labels (metrics_collector.py:1380-1394), global tp rank.

        The engine leaves `dp_rank` out without DP attention (its dp_rank is None there); a
        rank identity needs one, so it is 0 here. Expert parallelism is not modelled: moe_ep_rank 0.
        """
        labels: dict[str, Any] = {
            "model_name": model_name,
            "engine_type": engine_type,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "moe_ep_rank": 0,
            "dp_rank": self.attn_dp_rank if self.dp_attention else 0,
        }
        labels.update(extra or {})
        return labels
