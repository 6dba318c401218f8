"""A chat answer that a stop string ends (the front end aborts its engine request, though its
finish_reason is "stop") leaves its blocks in the prefix cache as one that ends at
``max_tokens`` does, so the next turn, which repeats it, computes only what is new."""

from __future__ import annotations

from rltserve import LLM, SamplingParams


def _first_at(text: str, at: int) -> str:
    """A 4-character string whose first occurrence in ``text`` is at or after ``at``."""
    return next(text[i : i + 4] for i in range(at, 0, -1) if text[i : i + 4] not in text[: i + 3])


def test_an_answer_ended_by_a_stop_string_is_cached_for_the_next_turn(tiny):
    with LLM(str(tiny), in_process=True, seed=0, max_model_len=256) as llm:
        prompt = llm.get_tokenizer().encode("You are Ada. " * 12)
        greedy = {"max_tokens": 60, "temperature": 0.0}
        text = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**greedy))
        stop = _first_at(text[0].outputs[0].text, len(text[0].outputs[0].text) - 12)
        cached = {}
        for kind, params in (("length", greedy), ("stop", {**greedy, "stop": [stop]})):
            llm.reset_prefix_cache()
            out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params))
            answer = list(out[0].outputs[0].token_ids)
            assert out[0].outputs[0].finish_reason == kind
            turn = prompt + answer + [5, 6, 7]
            nxt = llm.generate([{"prompt_token_ids": turn}], SamplingParams(max_tokens=1))
            # Positions with final KV: the prompt and every answer token but the last.
            full = (len(prompt) + len(answer) - 1) // 16 * 16
            cached[kind] = (nxt[0].num_cached_tokens, full)
    assert cached["stop"][0] == cached["stop"][1] > len(prompt)  # the answer's blocks too
    assert cached["length"][0] == cached["length"][1]
