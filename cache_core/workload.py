"""A deterministic multi-turn workload: sessions share system prompts with skewed popularity.

The replicas of a data-parallel group see the same requests in the same order (the stream is
seeded by the seed and the dp rank); different dp groups see different streams.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the synthetic traffic."""

    seed: int = 0
    system_prompts: int = 8
    system_prompt_tokens: tuple[int, int] = (192, 512)
    turn_tokens: tuple[int, int] = (16, 96)
    reply_tokens: tuple[int, int] = (16, 64)
    max_turns: int = 6
    active_sessions: int = 12
    new_session_probability: float = 0.2
    zipf_exponent: float = 1.2
    vocab: int = 32000


@dataclass
class _Session:
    history: list[int]
    turns: int = 0


@dataclass
class Workload:
    """The request stream of one dp group."""

    config: WorkloadConfig
    dp_rank: int
    _sessions: list[_Session] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.config
        # String seeds hash the same in every process, so replicas agree.
        prompts_rng = random.Random(f"prompts-{cfg.seed}")
        self.prompts = [self._tokens(prompts_rng, cfg.system_prompt_tokens) for _ in range(cfg.system_prompts)]
        self.weights = [1.0 / (rank + 1) ** cfg.zipf_exponent for rank in range(cfg.system_prompts)]
        self._rng = random.Random(f"requests-{cfg.seed}-{self.dp_rank}")

    def _tokens(self, rng: random.Random, bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(self.config.vocab) for _ in range(rng.randint(*bounds))]

    def next_request(self) -> list[int]:
        """The token ids of the next request: a session's history plus a new user turn."""
        cfg, rng = self.config, self._rng
        if len(self._sessions) < cfg.active_sessions and (not self._sessions or rng.random() < cfg.new_session_probability):
            prompt = rng.choices(self.prompts, weights=self.weights)[0]
            session = _Session(history=list(prompt))
            self._sessions.append(session)
        else:
            session = rng.choice(self._sessions)
        request = session.history + self._tokens(rng, cfg.turn_tokens)
        session.history = request + self._tokens(rng, cfg.reply_tokens)
        session.turns += 1
        if session.turns >= cfg.max_turns:
            self._sessions.remove(session)
        return request
