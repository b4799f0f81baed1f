"""A seeded request stream with the prefix sharing real serving traffic has.

Requests open with one of a few system prompts and continue multi-turn chats:
each turn of a conversation repeats the whole history plus a new user turn, so
consecutive requests of one conversation share ever longer prefixes, and
conversations share their system prompt. Some conversations use a LoRA adapter
(which changes every block hash of their prompt). Same seed, same stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvstream.errors import ConfigError

__all__ = ["Request", "Workload"]


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: its whole token sequence and the adapter it runs with."""

    token_ids: list[int]
    lora_name: str | None = None
    conversation: int = -1


@dataclass(slots=True)
class _Conversation:
    history: list[int]
    lora_name: str | None
    turns_left: int
    ident: int = field(default=0)


class Workload:
    """Reproducible prompts with shared prefixes; see the module doc."""

    def __init__(
        self,
        *,
        seed: int = 0,
        block_size: int = 16,
        vocab: int = 32_000,
        system_prompts: int = 8,
        system_prompt_blocks: tuple[int, int] = (2, 8),
        turn_tokens: tuple[int, int] = (16, 200),
        conversations: int = 64,
        max_turns: int = 8,
        lora_names: tuple[str, ...] = ("sql-adapter",),
        lora_fraction: float = 0.2,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size: expected a positive int, got {block_size!r}")
        if conversations <= 0 or system_prompts <= 0:
            raise ConfigError("Workload: conversations and system_prompts must be positive")
        self.block_size = block_size
        self._rng = random.Random(seed)
        self._vocab = vocab
        self._turn_tokens = turn_tokens
        self._max_turns = max_turns
        self._lora_names = lora_names
        self._lora_fraction = lora_fraction
        lo, hi = system_prompt_blocks
        self._system = [
            self._tokens(self._rng.randint(lo, hi) * block_size) for _ in range(system_prompts)
        ]
        self._next_ident = 0
        self._live = [self._new_conversation() for _ in range(conversations)]

    def _tokens(self, n: int) -> list[int]:
        rand = self._rng.randrange
        vocab = self._vocab
        return [rand(vocab) for _ in range(n)]

    def _new_conversation(self) -> _Conversation:
        rng = self._rng
        lora = None
        if self._lora_names and rng.random() < self._lora_fraction:
            lora = rng.choice(self._lora_names)
        self._next_ident += 1
        return _Conversation(
            history=list(rng.choice(self._system)),
            lora_name=lora,
            turns_left=rng.randint(1, self._max_turns),
            ident=self._next_ident,
        )

    def next_request(self) -> Request:
        """The next prompt: a new turn of a random live conversation."""
        rng = self._rng
        i = rng.randrange(len(self._live))
        conv = self._live[i]
        lo, hi = self._turn_tokens
        conv.history.extend(self._tokens(rng.randint(lo, hi)))
        request = Request(list(conv.history), conv.lora_name, conv.ident)
        # The model's answer becomes part of the history of the next turn.
        conv.history.extend(self._tokens(rng.randint(lo, hi)))
        conv.turns_left -= 1
        if conv.turns_left <= 0:
            self._live[i] = self._new_conversation()
        return request

    def next_requests(self, n: int) -> list[Request]:
        return [self.next_request() for _ in range(n)]
