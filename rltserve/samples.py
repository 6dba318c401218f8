"""The ``n`` samples of a request as ``n`` single-sample requests, and the seed of each (vLLM's
``seed + j``, never vLLM's "no seed")."""

from __future__ import annotations

from rltserve.sampling import SamplingParams


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: ``seed + index``
    (vLLM's). Only the seed a user gives may be vLLM's "no seed" (-1): a derived -1 is written
    2**64 - 1, the seed torch reads for it, so that the sample is seeded all the same."""
    derived = seed + index
    return 2**64 - 1 if derived == -1 else derived


def expand_samples(params: SamplingParams) -> list[SamplingParams]:
    """The ``n`` single-sample requests that make up ``params``: sample j is seeded with
    ``sample_seed(seed, j)`` when ``seed`` is set (the HTTP server's convention) and unseeded
    otherwise. Only the first scores the prompt (``prompt_logprobs``: the same for every
    sample), so the others may share its prefill."""
    if params.n == 1:
        return [params]
    return [
        params.replace(
            n=1,
            best_of=None,
            seed=None if params.seed is None else sample_seed(params.seed, j),
            prompt_logprobs=params.prompt_logprobs if j == 0 else None,
        )
        for j in range(params.n)
    ]


def sample_ids(prompt_id: str, n: int) -> tuple[list[str], str | None]:
    """The stage ids of a prompt's ``n`` samples, vLLM's (the prompt's id for one sample, else
    "j_<id>" for sample j), and their group (the prompt's id when n > 1: the samples of one
    prompt share its prefill, which the stage computes once; None for one sample)."""
    if n == 1:
        return [prompt_id], None
    return [f"{j}_{prompt_id}" for j in range(n)], prompt_id
