from rltserve.http.context_limit import chars_too_many, prompt_too_long, tokens_too_many

HEAD = "This model's maximum context length is 64 tokens. "
NOTE = " (This limit is what the server's KV cache holds.)"


def test_a_prompt_past_the_context_in_vllms_words():
    assert prompt_too_long(70, 64, False) == (
        HEAD + "However, your request has 70 input tokens. Please reduce the length of the "
        "input messages."
    )
    assert prompt_too_long(64, 64, True) == (
        HEAD + "However, your request has 64 input tokens, which leave no room for the "
        "completion. Please reduce the length of the input messages." + NOTE
    )


def test_max_tokens_past_the_context_in_vllms_words():
    assert tokens_too_many(10, 60, 64, False) == (
        HEAD + "However, you requested 70 tokens (10 in the messages, 60 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    assert tokens_too_many(10, 60, 64, True).endswith("or completion." + NOTE)


def test_a_text_past_the_character_bound_in_vllms_words():
    assert chars_too_many(1000, 64, 13, True) == (
        HEAD + "However, your request has 1000 input characters, more than 832 (no token covers "
        "more than 13). Please reduce the length of the input messages." + NOTE
    )
