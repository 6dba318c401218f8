"""Oracles of two per-request features, as steers of ``Reference.generate`` (its ``steer``: seen
before each output token): bounded thinking's forced end of a thinking span, a structured
output's constraint (a choice of strings or a regular expression), and both together (the
constraint on the answer after the span: ``Answer``).

Written from README's rules alone and, like the oracle, never importing ``rltserve``. The
constraint is not compiled to an automaton over token bytes, as the engine's guide is: each
candidate token is checked directly on the decoded text (the tokenizer's own decode of the
output so far plus that token), against the choices' prefixes or with the ``regex`` module's
partial matching."""

from __future__ import annotations

import json
from pathlib import Path

import regex
from tokenizers import Tokenizer


def _contains(seq: list[int] | tuple[int, ...], part: tuple[int, ...]) -> bool:
    n = len(part)
    return any(tuple(seq[i : i + n]) == part for i in range(len(seq) - n + 1))


class ThinkingBudget:
    """README's bounded thinking, for a request whose thinking span is open from the start of
    its output: after ``budget`` output tokens (0: before the first) without the end ids, the
    interruption and the end ids are output unsampled (the interruption alone where it holds
    the end ids), then the answer is sampled as any token; a negative budget bounds nothing."""

    def __init__(self, budget: int, interruption: tuple[int, ...], end: tuple[int, ...]) -> None:
        self.budget, self.end = budget, tuple(end)
        interruption = tuple(interruption)
        closes = _contains(interruption, self.end)
        self.forced_ids = list(interruption) if closes else [*interruption, *self.end]

    def forced(self, tokens: list[int]) -> int | None:
        j = len(tokens) - self.budget
        if self.budget < 0 or not 0 <= j < len(self.forced_ids):
            return None
        if _contains(tokens[: self.budget], self.end):  # (the model ended its thinking)
            return None
        return self.forced_ids[j]

    def forced_at(self, tokens: list[int]) -> set[int]:
        """The indices of ``tokens`` (an output) that this rule forced."""
        return {j for j in range(len(tokens)) if self.forced(tokens[:j]) is not None}

    def allowed(self, tokens: list[int]) -> None:
        return None


class Constraint:
    """A structured output's constraint (README's "Structured outputs"): after the output
    so far, whose text is ``s``, a token ``t`` is allowed iff the text of output + ``t`` is
    longer than ``s`` and a prefix of a full match (a choice, or the regex's full match) and
    the end id (the model's first EOS id) iff ``s`` is a full match; after the end id, the end
    id alone. Special tokens (the tokenizer's) are never allowed otherwise."""

    def __init__(
        self,
        checkpoint: str | Path,
        end_id: int,
        vocab: int,
        *,
        choice: list[str] | None = None,
        pattern: str | None = None,
    ) -> None:
        if (choice is None) == (pattern is None):
            raise ValueError("give one of choice and pattern")
        path = Path(checkpoint) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path))
        added = json.loads(path.read_text()).get("added_tokens", [])
        self.special = {t["id"] for t in added if t.get("special")}
        self.end_id, self.vocab = end_id, vocab
        self.choice = None if choice is None else list(choice)
        self.pattern = None if pattern is None else regex.compile(pattern)

    def _prefix(self, text: str) -> bool:
        if self.choice is not None:
            return any(c.startswith(text) for c in self.choice)
        return self.pattern.fullmatch(text, partial=True) is not None

    def matched(self, text: str) -> bool:
        if self.choice is not None:
            return text in self.choice
        return self.pattern.fullmatch(text) is not None

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def forced(self, tokens: list[int]) -> None:
        return None

    def allowed(self, tokens: list[int]) -> list[int]:
        if self.end_id in tokens:
            return [self.end_id]
        text = self.text(tokens)
        candidates = [t for t in range(self.vocab) if t not in self.special]
        texts = self.tokenizer.decode_batch(
            [[*tokens, t] for t in candidates], skip_special_tokens=False
        )
        ok = [t for t, s in zip(candidates, texts) if len(s) > len(text) and self._prefix(s)]
        return ok + [self.end_id] if self.matched(text) else ok

    def first_outside(self, tokens: list[int]) -> int | None:
        """The first index of ``tokens`` (an output) the constraint did not allow, or None."""
        return next((j for j, t in enumerate(tokens) if t not in self.allowed(tokens[:j])), None)


class Answer:
    """A constraint with a thinking budget (README's "Structured outputs"): the budget's span is
    open from the start of the output, its tokens free and its forced ids forced; the answer
    starts after the span's end, the end ids where the output holds them within its first
    ``budget`` tokens (the model closed it), else after the forced ids, and the constraint
    applies to the answer alone (its text, from its first token)."""

    def __init__(self, budget: ThinkingBudget, constraint: Constraint) -> None:
        self.budget, self.constraint = budget, constraint

    def start(self, tokens: list[int]) -> int | None:
        """Where the answer starts in an output beginning ``tokens`` (None: not yet)."""
        k, end = self.budget.budget, self.budget.end
        n = len(end)
        closed = next((i for i in range(n, k + 1) if tuple(tokens[i - n : i]) == end), None)
        if closed is not None:
            return closed
        begins = k + len(self.budget.forced_ids)
        return begins if len(tokens) >= begins else None

    def text(self, tokens: list[int]) -> str:
        return self.constraint.text(tokens)

    def forced(self, tokens: list[int]) -> int | None:
        return self.budget.forced(tokens)

    def forced_at(self, tokens: list[int]) -> set[int]:
        return self.budget.forced_at(tokens)

    def allowed(self, tokens: list[int]) -> list[int] | None:
        start = self.start(tokens)
        return None if start is None else self.constraint.allowed(tokens[start:])

    def first_outside(self, tokens: list[int]) -> int | None:
        """The first index of ``tokens`` (an output) the constraint did not allow, or None."""
        for j, token in enumerate(tokens):
            allowed = self.allowed(tokens[:j])
            if allowed is not None and token not in allowed:
                return j
        return None
