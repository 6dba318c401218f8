"""Property-based fuzzing of the offline API: ``LLM.generate`` on the tiny model with generated
prompts (text, token ids inside and outside the vocabulary, wrong types) and sampling settings.
Each call returns outputs or raises a ValueError naming the bad input, within a bounded time,
and leaves the engine idle."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from script_util import load_script

from rltserve import LLM
from rltserve.sampling import SamplingParams

fuzz = load_script("fuzz_http")

CALL_TIMEOUT_S = 60.0
PROMPT = st.one_of(
    st.text(max_size=30),
    fuzz.TOKEN_IDS,
    st.lists(st.integers(0, 511), min_size=1, max_size=8),
    fuzz.JSON,
)
PROMPTS = PROMPT | st.lists(PROMPT, max_size=3)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = fuzz.tiny_checkpoint(tmp_path_factory.getbasetemp())
    with LLM(str(path), in_process=True, num_blocks=256, max_num_seqs=8) as llm:
        yield llm


def _idle(llm: LLM) -> bool:
    stats = llm._client.stats
    return stats is None or (
        stats.num_running == 0 and stats.num_waiting == 0 and not stats.kv_usage
    )


def _generate(llm: LLM, prompts, params):
    """``llm.generate`` on a daemon thread: (outputs, exception); a hang fails the test."""
    result: list = []

    def call() -> None:
        try:
            result.append((llm.generate(prompts, params), None))
        except Exception as exc:  # noqa: BLE001 - judged by the test
            result.append((None, exc))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(CALL_TIMEOUT_S)
    assert result, f"generate({prompts!r:.200}) did not return within {CALL_TIMEOUT_S} s"
    return result[0]


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(prompts=PROMPTS, kwargs=fuzz.SAMPLING_KWARGS)
def test_generate_returns_or_names_the_bad_input(llm, prompts, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        params = SamplingParams(temperature=0.0, max_tokens=4)
    outputs, error = _generate(llm, prompts, params)
    if error is not None:
        assert isinstance(error, ValueError), repr(error)
        assert str(error).split(":", 1)[0].split("=", 1)[0].strip(), error
    else:
        assert all(o.finish_reason in ("stop", "length") for o in outputs), outputs
    deadline = time.monotonic() + 10
    while not _idle(llm):
        assert time.monotonic() < deadline, llm._client.stats
        time.sleep(0.01)
