"""A synthetic multi-turn chat workload: shared system prompts, branching conversations.

Each request is the full token history of one conversation turn, so a prefix
cache sees what a serving engine sees: a few system prompts shared by every
conversation, conversations that grow turn by turn, and forks where a user
regenerates or edits an earlier turn. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatWorkload:
    """Parameters of the trace.

    Attributes:
        requests: Requests to generate.
        system_prompts: Distinct system prompts shared across conversations.
        system_tokens: Tokens per system prompt.
        turn_tokens: Tokens added per turn (user message plus reply).
        max_turns: Turns after which a conversation ends and a new one starts.
        live: Conversations interleaved at any time.
        fork_rate: Probability that a turn branches from an earlier turn.
        vocab: Token id range.
        seed: Random seed.
    """

    requests: int = 1000
    system_prompts: int = 4
    system_tokens: int = 128
    turn_tokens: int = 48
    max_turns: int = 8
    live: int = 16
    fork_rate: float = 0.15
    vocab: int = 32000
    seed: int = 0


@dataclass(frozen=True)
class Request:
    """One turn to serve: the conversation's tokens so far."""

    conversation: int
    turn: int
    tokens: tuple[int, ...]


def requests(spec: ChatWorkload) -> Iterator[Request]:
    """Yield the trace's requests in arrival order."""
    rng = random.Random(spec.seed)
    prompts = [_tokens(rng, spec.system_tokens, spec.vocab) for _ in range(spec.system_prompts)]
    live: dict[int, list[tuple[int, ...]]] = {}
    next_id = 0
    for _ in range(spec.requests):
        if len(live) < spec.live:
            live[next_id] = [prompts[rng.randrange(len(prompts))]]
            next_id += 1
        conv = rng.choice(list(live))
        turns = live[conv]
        if len(turns) > 1 and rng.random() < spec.fork_rate:
            del turns[rng.randrange(1, len(turns)) :]  # regenerate from an earlier turn
        turns.append(turns[-1] + _tokens(rng, spec.turn_tokens, spec.vocab))
        yield Request(conv, len(turns) - 1, turns[-1])
        if len(turns) > spec.max_turns:
            del live[conv]


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))
