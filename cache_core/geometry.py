"""Model and shard geometry: how many bytes one token's KV takes on one rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True)
class ModelGeometry:
    """The KV cache shape of a whole model (MLA: one latent vector per token and layer, not split by tp)."""

    layers: int = 6
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float16"
    page_size: int = 16
    mla: bool = False

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim, self.page_size) < 1:
            raise ValueError("layers, kv_heads, head_dim and page_size must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def shard(
        self, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, cp_rank: int = 0, cp_size: int = 1
    ) -> ShardGeometry:
        """The part of the KV cache held by one rank: heads / tp (all for MLA) of its pp stage's layers.

        Context parallelism (NSA-CP, as the engine's file backend keys it: each CP rank "holds a
        disjoint slice of every page", hicache_storage.py:751-754) gives each CP rank
        page_size / cp_size token slots of every page: its pages are 1/cp of the bytes.
        """
        if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size and 0 <= cp_rank < cp_size):
            raise ValueError(f"rank tp={tp_rank}/{tp_size} pp={pp_rank}/{pp_size} cp={cp_rank}/{cp_size} is out of range")
        if self.page_size % cp_size:
            raise ValueError(f"page_size {self.page_size} does not split evenly over cp_size {cp_size}")
        if pp_size > self.layers:
            raise ValueError(f"pp_size {pp_size} exceeds the model's {self.layers} layers")
        if self.mla:
            heads = 1
        else:
            if self.kv_heads % tp_size:
                raise ValueError(f"kv_heads {self.kv_heads} do not split evenly over tp_size {tp_size}")
            heads = self.kv_heads // tp_size
        # Earlier pipeline stages take the remainder layers, as uneven splits usually do.
        base, extra = divmod(self.layers, pp_size)
        layers = base + (1 if pp_rank < extra else 0)
        return ShardGeometry(model=self, layers=layers, heads=heads, cp_size=cp_size)


@dataclass(frozen=True)
class ShardGeometry:
    """One rank's shard: its layers and heads of `page_size / cp_size` token slots of every page
    (K and V, or the latent)."""

    model: ModelGeometry
    layers: int
    heads: int
    cp_size: int = 1

    @property
    def page_tokens(self) -> int:
        """Token slots of one page this rank holds (its CP slice)."""
        return self.model.page_size // self.cp_size

    @property
    def kv_planes(self) -> int:
        return 1 if self.model.mla else 2

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page: (layers, K/V, tokens of this rank's slice, heads, head_dim)."""
        m = self.model
        return (self.layers, self.kv_planes, self.page_tokens, self.heads, m.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token slot this rank holds (a logical token costs 1/cp_size of it on average)."""
        m = self.model
        return self.layers * self.kv_planes * self.heads * m.head_dim * m.torch_dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_tokens
