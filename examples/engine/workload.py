"""Workloads for the engine demo: multi-turn conversations (default) and requests
synthesized from a Mooncake trace.

A workload hands the scheduler the requests that arrive at a step and hears when
one finishes, so conversations run closed-loop: the next turn's prompt is the
history so far (system prompt, earlier user messages, the model's own answers)
plus a new message, and it arrives a few steps after the previous answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tools.trace_replay import TraceRequest


@dataclass(slots=True)
class Prompt:
    request_id: str
    tokens: list[int]
    max_new_tokens: int


class Workload(Protocol):
    def arrivals(self, step: int) -> list[Prompt]:
        """Requests arriving at `step`."""
        ...

    def finished(self, request_id: str, output: list[int], step: int) -> None:
        """A request finished at `step` with `output`."""
        ...

    def done(self) -> bool:
        """No request will arrive any more."""
        ...

    @property
    def total_requests(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    conversations: int = 16
    turns: int = 4
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (96, 192)
    user_tokens: tuple[int, int] = (24, 80)
    new_tokens: int = 12
    think_steps: tuple[int, int] = (0, 4)
    arrival_gap: int = 2
    vocab_size: int = 4096
    seed: int = 0


@dataclass(slots=True)
class _Conversation:
    index: int
    history: list[int]
    rng: random.Random  # its own, so its content never depends on scheduling
    turn: int = 0
    next_step: int = 0
    waiting: bool = False  # a turn is being served


class MultiTurnChat:
    """Conversations sharing a few system prompts; each turn's prompt is the whole
    history, so earlier turns are prefix hits (on the device, or on the host once
    the device needed the room). What a conversation says depends only on the seed
    and the model's answers, never on when the engine serves it."""

    def __init__(self, spec: ConversationSpec = ConversationSpec()) -> None:
        self.spec = spec
        rng = random.Random(spec.seed)
        systems = [self._tokens(rng, *spec.system_tokens) for _ in range(spec.system_prompts)]
        self._convs = [
            _Conversation(
                i,
                list(systems[i % len(systems)]),
                random.Random(f"{spec.seed}/{i}"),
                next_step=i * spec.arrival_gap,
            )
            for i in range(spec.conversations)
        ]
        self._by_request: dict[str, _Conversation] = {}

    @property
    def total_requests(self) -> int:
        return self.spec.conversations * self.spec.turns

    def arrivals(self, step: int) -> list[Prompt]:
        out = []
        for conv in self._convs:
            if conv.waiting or conv.turn >= self.spec.turns or conv.next_step > step:
                continue
            conv.history += self._tokens(conv.rng, *self.spec.user_tokens)
            request_id = f"c{conv.index}t{conv.turn}"
            conv.waiting = True
            self._by_request[request_id] = conv
            out.append(Prompt(request_id, list(conv.history), self.spec.new_tokens))
        return out

    def finished(self, request_id: str, output: list[int], step: int) -> None:
        conv = self._by_request.pop(request_id)
        conv.history += output
        conv.turn += 1
        conv.waiting = False
        conv.next_step = step + 1 + conv.rng.randint(*self.spec.think_steps)

    def done(self) -> bool:
        return all(c.turn >= self.spec.turns for c in self._convs)

    def _tokens(self, rng: random.Random, low: int, high: int) -> list[int]:
        return [rng.randrange(self.spec.vocab_size) for _ in range(rng.randint(low, high))]


class TraceWorkload:
    """Mooncake trace requests in timestamp order, `per_step` arriving per step.

    A hash id stands for `tokens_per_block` tokens drawn from a PRNG seeded with
    the id, so equal prefixes of ids give equal token prefixes (and equal block
    hashes); the last block is cut to the request's scaled input length.
    """

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        *,
        tokens_per_block: int = 8,
        new_tokens: int = 8,
        per_step: int = 2,
        vocab_size: int = 4096,
    ) -> None:
        self._queue = list(trace)
        self._next = 0
        self.tokens_per_block = tokens_per_block
        self.new_tokens = new_tokens
        self.per_step = per_step
        self.vocab_size = vocab_size
        self._blocks: dict[int, list[int]] = {}

    @property
    def total_requests(self) -> int:
        return len(self._queue)

    def arrivals(self, step: int) -> list[Prompt]:
        out = []
        while self._next < len(self._queue) and len(out) < self.per_step:
            out.append(self._prompt(self._next))
            self._next += 1
        return out

    def prompts(self) -> list[Prompt]:
        """Every request this workload will send, in order (arrivals unchanged)."""
        return [self._prompt(i) for i in range(len(self._queue))]

    def _prompt(self, index: int) -> Prompt:
        request = self._queue[index]
        return Prompt(f"r{index}", self.tokens(request), self.new_tokens)

    def tokens(self, request: TraceRequest) -> list[int]:
        """The prompt synthesized for `request`: its input length scaled from the
        trace's 512-token blocks to `tokens_per_block`."""
        scaled = max(1, request.input_length * self.tokens_per_block // 512)
        return [t for h in request.hash_ids for t in self._block(h)][:scaled]

    def finished(self, request_id: str, output: list[int], step: int) -> None:
        pass

    def done(self) -> bool:
        return self._next >= len(self._queue)

    def _block(self, hash_id: int) -> list[int]:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rng = random.Random(hash_id)
            tokens = [rng.randrange(self.vocab_size) for _ in range(self.tokens_per_block)]
            self._blocks[hash_id] = tokens
        return tokens


def trace_sessions(
    trace: Sequence[TraceRequest], count: int, *, fits: Callable[[TraceRequest], bool]
) -> tuple[list[TraceRequest], int]:
    """The requests of the trace's first `count` multi-turn sessions whose every
    request `fits` (the device pool), in trace order, and how many sessions before
    them were passed over because one of their requests does not fit.

    A trace id names a prefix (the block and every block before it), so a request
    continues the earlier request that first held the longest of its ids; a
    session is a request that continues none (by at least two blocks: every
    request starts with id 0) and the requests that continue it or its
    continuations. Sessions of one request are not sessions here.

    Raises:
        ValueError: `count` < 1."""
    if count < 1:
        raise ValueError(f"count: must be >= 1, got {count}")
    first: dict[int, int] = {}  # id -> first request holding it
    root: list[int] = []
    for i, r in enumerate(trace):
        parent = next((first[h] for h in reversed(r.hash_ids[1:]) if h in first), None)
        root.append(i if parent is None else root[parent])
        for h in r.hash_ids:
            first.setdefault(h, i)
    members: dict[int, list[int]] = {}
    for i, rt in enumerate(root):
        members.setdefault(rt, []).append(i)
    chosen: list[int] = []
    passed = taken = 0
    for rt in sorted(members):
        if taken == count:
            break
        if len(members[rt]) < 2:
            continue
        if all(fits(trace[i]) for i in members[rt]):
            chosen += members[rt]
            taken += 1
        else:
            passed += 1
    return [trace[i] for i in sorted(chosen)], passed
