"""The prompts ``rltserve bench serve`` sends: vLLM's ``random`` dataset, as token ids.

Each conversation draws its prompt length and output length uniformly from
``[floor(len * (1 - r)), ceil(len * (1 + r))]`` for ``r = range_ratio`` (as vLLM's
``--random-range-ratio``; an output at least 1 token), then its prompt's tokens uniformly from
the vocabulary (a multi-turn conversation's new user messages have its prompt length, each of
its turns its output length). The draws are seeded by ``seed``; at ``r = 0`` no length is
drawn, so the prompts are those of a run without the flag.

With ``prefix_len`` (vLLM's ``--random-prefix-len``) every prompt starts with the same
``prefix_len`` random tokens, drawn once, then has its own: a prompt has ``prefix_len`` + its
drawn length tokens (as vLLM's, ``input_len`` leaves the prefix out, and the range ratio does
not vary it). The prefix is a stream of its own, so the tokens after it are those of a run
without it.

Token ids are drawn from a pool: the vocabulary less the tokenizer's special ids, as recent
vLLM's (``--tokenizer`` gives them; the server's model card does not, so without it every id
of the vocabulary may be drawn). With no special id the pool is the whole vocabulary and the
draws are those of ``randrange(vocab_size)``.
"""

from __future__ import annotations

import math
import random

from rltserve.bench.serve_config import BenchConfig


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    return math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))


def request_lengths(config: BenchConfig) -> list[tuple[int, int]]:
    """Each conversation's (prompt tokens after the shared prefix, output tokens)."""
    if config.range_ratio == 0:
        return [(config.input_len, config.output_len)] * config.num_prompts
    # (a stream of its own: the prompts' and the arrivals' draws stay those of other runs)
    rng = random.Random(f"{config.seed}:lengths")
    low_in, high_in = _length_range(config.input_len, config.range_ratio)
    low_out, high_out = _length_range(config.output_len, config.range_ratio)
    return [
        (rng.randint(low_in, high_in), rng.randint(max(low_out, 1), high_out))
        for _ in range(config.num_prompts)
    ]


def token_pool(vocab_size: int, special_ids: frozenset[int] = frozenset()) -> range | list[int]:
    """The ids random prompts are drawn from: the vocabulary less ``special_ids``."""
    if not special_ids.intersection(range(vocab_size)):
        return range(vocab_size)
    return [i for i in range(vocab_size) if i not in special_ids]


def random_prompts(
    config: BenchConfig, vocab_size: int, pool: range | list[int] | None = None
) -> list[list[int]]:
    """Each conversation's first prompt; ids from ``pool`` (default: the whole vocabulary)."""
    pool = range(vocab_size) if pool is None else pool
    shared = random.Random(f"{config.seed}:prefix")
    prefix = [pool[shared.randrange(len(pool))] for _ in range(config.prefix_len)]
    rng = random.Random(config.seed)
    return [
        prefix + [pool[rng.randrange(len(pool))] for _ in range(input_len)]
        for input_len, _ in request_lengths(config)
    ]
