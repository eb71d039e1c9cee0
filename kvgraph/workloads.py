"""Named benchmark workloads: seeded random prompts with a fixed number of new tokens each."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvgraph.errors import ConfigError

FIRST_TOKEN = 3  # below are <pad>, <s>, </s> in the presets' vocabulary


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) that each generate exactly ``max_new_tokens`` tokens (EOS ignored)."""

    name: str
    prompts: list[list[int]]
    max_new_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_seq_len(self) -> int:
        """The longest context a request reaches."""
        return max(len(p) for p in self.prompts) + self.max_new_tokens


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    max_new_tokens: int
    prompts: Callable[[random.Random, int, Callable[[int], list[int]]], list[list[int]]]


def _mixed(rng: random.Random, n: int, tokens: Callable[[int], list[int]]) -> list[list[int]]:
    return [tokens(rng.randint(16, 256)) for _ in range(n)]


def _decode_heavy(rng: random.Random, n: int, tokens: Callable[[int], list[int]]) -> list[list[int]]:
    return [tokens(32) for _ in range(n)]


def _shared_prefix(rng: random.Random, n: int, tokens: Callable[[int], list[int]]) -> list[list[int]]:
    system = tokens(512)
    return [system + tokens(rng.randint(16, 64)) for _ in range(n)]


WORKLOADS: dict[str, WorkloadSpec] = {
    w.name: w
    for w in (
        WorkloadSpec("mixed", "prompts of 16..256 tokens, 64 new tokens each", 64, _mixed),
        WorkloadSpec("decode-heavy", "32-token prompts, 256 new tokens each", 256, _decode_heavy),
        WorkloadSpec(
            "shared-prefix", "a common 512-token system prompt + 16..64 own tokens, 64 new tokens",
            64, _shared_prefix,
        ),
    )
}


def workload_names() -> list[str]:
    return list(WORKLOADS)


def make_workload(
    name: str,
    *,
    num_requests: int,
    vocab_size: int,
    seed: int = 0,
    max_new_tokens: int | None = None,
) -> Workload:
    """Build workload ``name`` with ``num_requests`` prompts of ids in ``[3, vocab_size)``.

    ``max_new_tokens`` overrides the workload's own output length.
    """
    spec = WORKLOADS.get(name)
    if spec is None:
        raise ConfigError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    for label, value in (("num_requests", num_requests), ("max_new_tokens", max_new_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{label} must be an int >= 1, got {value!r}")
    if vocab_size <= FIRST_TOKEN:
        raise ConfigError(f"vocab_size must exceed {FIRST_TOKEN}, got {vocab_size}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(n)]

    new = max_new_tokens if max_new_tokens is not None else spec.max_new_tokens
    return Workload(name, spec.prompts(rng, num_requests, tokens), new)
