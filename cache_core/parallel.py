"""Where a rank sits in the tp/pp/dp layout, and the metric labels that follow from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.labels import radix_cache_metric_labels


@dataclass(frozen=True)
class ParallelState:
    """The parallel ranks of one scheduler process, named as the upstream engine names them.

    With DP attention the tp ranks of a pipeline stage are split into `dp_size` attention groups
    of `attn_tp_size` ranks each: tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank.
    """

    tp_rank: int
    pp_rank: int
    attn_tp_rank: int
    attn_dp_rank: int
    tp_size: int
    pp_size: int
    attn_tp_size: int
    dp_size: int

    @classmethod
    def from_layout(
        cls, attn_tp_rank: int, pp_rank: int, dp_rank: int, attn_tp_size: int, pp_size: int, dp_size: int
    ) -> ParallelState:
        """The state of the rank at (attention tp rank, pp rank, dp group) of a layout."""
        for name, rank, size in (("tp", attn_tp_rank, attn_tp_size), ("pp", pp_rank, pp_size), ("dp", dp_rank, dp_size)):
            if not 0 <= rank < size:
                raise ValueError(f"{name} rank {rank} is outside 0..{size - 1}")
        return cls(
            tp_rank=dp_rank * attn_tp_size + attn_tp_rank,
            pp_rank=pp_rank,
            attn_tp_rank=attn_tp_rank,
            attn_dp_rank=dp_rank,
            tp_size=attn_tp_size * dp_size,
            pp_size=pp_size,
            attn_tp_size=attn_tp_size,
            dp_size=dp_size,
        )

    @property
    def dp_attention(self) -> bool:
        return self.dp_size > 1

    def metric_labels(self, cache_type: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upstream rank labels for this rank, with operator labels merged on top."""
        labels = radix_cache_metric_labels(cache_type, self, self.dp_attention)
        labels.update(extra or {})
        return labels
