"""``LLM.chat`` and ``LLM.preprocess_chat``: conversations rendered with the checkpoint's chat
template as the server's chat endpoint renders them, then generated (a mixin of ``LLM``, whose
``tokenizer`` and ``_generate`` it uses)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
from tqdm import tqdm

from rltserve.outputs import RequestOutput
from rltserve.prompt_inputs import normalize_prompts, template_message
from rltserve.sampling import SamplingParams
from rltserve.thinking import chat_prompt
from rltserve.vllm_args import CONTENT_FORMATS


class ChatRendering:
    """vLLM's chat methods of ``LLM``."""

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: each conversation (a list of ``{"role": ..., "content": ...}``
        messages; one conversation or a list of them) rendered with the checkpoint's chat
        template (or ``chat_template``), as the server's chat endpoint renders it
        (``enable_thinking`` among ``chat_template_kwargs`` opens the thinking span), then
        ``generate``d: one ``RequestOutput`` per conversation, its ``prompt`` the rendered text.
        ``continue_final_message`` leaves the last message open for the model to continue.
        ``tools`` (OpenAI's tool definitions) go to the template as its ``tools``, as vLLM's
        (the output is the model's text: parsing calls out of it is the caller's);
        ``lora_request`` and ``mm_processor_kwargs`` must be None (no adapters or images);
        content parts are joined text whatever the content format, no content (an assistant
        turn carrying ``tool_calls``) is "" and the calls' JSON arguments dicts (vLLM's). A
        template that raises on a conversation is a ValueError naming the conversation."""
        prompts, thinking = self._render_chats(
            messages,
            lora_request,
            chat_template,
            chat_template_content_format,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
            mm_processor_kwargs,
        )
        return self._generate(normalize_prompts(prompts), sampling_params, use_tqdm, None, thinking)

    def preprocess_chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: None = None,
    ) -> list[dict[str, Any]]:
        """vLLM's: each conversation rendered as ``chat`` renders it, as a prompt dict for
        ``generate``: ``{"prompt": text, "prompt_token_ids": ids}`` (vLLM's ``TokensPrompt``
        holds the ids; the text is the rendering they encode)."""
        return self._render_chats(
            messages,
            lora_request,
            chat_template,
            chat_template_content_format,
            add_generation_prompt,
            continue_final_message,
            tools,
            chat_template_kwargs,
            mm_processor_kwargs,
        )[0]

    def _render_chats(
        self,
        messages,
        lora_request,
        chat_template,
        chat_template_content_format,
        add_generation_prompt,
        continue_final_message,
        tools,
        chat_template_kwargs,
        mm_processor_kwargs,
    ) -> tuple[list[dict[str, Any]], list[bool | None]]:
        """``chat``'s prompts (``preprocess_chat``'s) and whether each leaves a thinking span
        open (``ChatPrompt.thinking``)."""
        for name, value in (
            ("lora_request", lora_request),
            ("mm_processor_kwargs", mm_processor_kwargs),
        ):
            if value is not None:
                raise ValueError(f"{name}: not supported (must be None)")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format={chat_template_content_format!r}: must be one "
                f"of {', '.join(CONTENT_FORMATS)} (text parts are joined in any of them)"
            )
        if self.tokenizer is None:
            raise ValueError("messages: chat needs the checkpoint's tokenizer and chat template")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages: must be a non-empty list of messages or of conversations")
        one = isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        if tools:  # (an empty list asks for nothing)
            if isinstance(tools, (str, Mapping)) or not all(isinstance(t, Mapping) for t in tools):
                raise ValueError("tools: must be a list of tool definitions (dicts)")
            kwargs["tools"] = [dict(t) for t in tools]
        tokenizer = self.tokenizer

        def render(turns, generation_prompt: bool, continue_final: bool) -> str:
            return tokenizer.apply_chat_template(
                turns,
                generation_prompt,
                tokenize=False,
                chat_template=chat_template,
                continue_final_message=continue_final,
                **kwargs,
            )

        prompts, thinking = [], []
        for c, conversation in enumerate(conversations):
            if not isinstance(conversation, Sequence) or isinstance(conversation, str):
                raise ValueError(f"messages[{c}]: must be a list of messages")
            turns = [template_message(m, f"messages[{c}][{i}]") for i, m in enumerate(conversation)]
            try:
                chat = chat_prompt(
                    render, turns, add_generation_prompt, continue_final_message, kwargs, tokenizer
                )
            except ValueError:  # (rltserve's own: they name what is wrong)
                raise
            except jinja2.TemplateSyntaxError as exc:  # (only a given template is compiled here)
                raise ValueError(f"chat_template: the template does not compile: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - template code raising on its input
                raise ValueError(
                    f"messages[{c}]: the chat template failed on this conversation: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            ids = tokenizer.encode(chat.text, add_special_tokens=False)  # (the template has them)
            prompts.append({"prompt": chat.text, "prompt_token_ids": ids})
            thinking.append(chat.thinking)
        return prompts, thinking
