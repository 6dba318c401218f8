"""The users of ``scripts/soak_chat.py``: chat conversations under one shared system prompt,
through the ``openai`` SDK and raw aiohttp, and the bookkeeping of what they were told."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_probe import GAUGES_AT_IDLE, parse_metrics  # noqa: E402

REQUEST_TIMEOUT_S = 300.0  # a request not ended by then is "stuck"
TOPICS = "refunds, baggage, visas, hotel upgrades, rail passes, travel insurance, lost luggage"


def system_prompt(rules: int = 12) -> str:
    """The system prompt every user shares (about 110 tokens a rule with the demo tokenizer)."""
    return " ".join(
        f"Rule {i}: you are the travel desk assistant of Example Tours; answer questions about "
        f"{TOPICS} politely and briefly, never invent prices, and ask for the booking code."
        for i in range(1, rules + 1)
    )


QUESTIONS = [
    "Hi, my flight was cancelled. What now?",
    "Can I bring a bike on the train?",
    "My booking code is XK42, can you check my hotel?",
    "How long does a visa for Japan take?",
    "Thanks! And what about travel insurance?",
    "Is breakfast included in the upgrade?",
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "find_booking", "parameters": {"type": "object"}}},
]
REPLY_SCHEMA = {
    "type": "object",
    "properties": {"mood": {"enum": ["happy", "sad"]}, "score": {"type": "integer"}},
    "required": ["mood", "score"],
}
BAD_BODIES = [  # (body, status): each must be refused, never a 5xx
    ({"messages": [], "max_tokens": 4}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "model": "no-such-model"}, 404),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "bogus"}, 400),
]
WEIGHTS = {  # kind -> share of a user's requests
    "sdk_stream": 30,
    "sdk_plain": 16,
    "raw_stream": 10,
    "cut": 10,
    "n_logprobs": 8,
    "stop": 8,
    "json": 4,
    "tools": 4,
    "completion": 5,
    "bad": 5,
}


def engine_reason(reason: str | None) -> str:
    """The engine's finished_reason of an answer's (a forced tool call stops the engine)."""
    return "stop" if reason == "tool_calls" else str(reason)


class Soak:
    def __init__(self, url: str, pid: int, prefix: str, system: str) -> None:
        self.url, self.pid, self.prefix, self.system = url, pid, prefix, system
        self.sdk = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="soak", max_retries=0, timeout=REQUEST_TIMEOUT_S
        )
        self.session: aiohttp.ClientSession | None = None
        self.model = ""
        self.gate = asyncio.Event()
        self.gate.set()
        self.inflight = 0
        self.counts: Counter = Counter()  # kind/outcome -> requests
        self.errors: Counter = Counter()
        self.finished: Counter = Counter()  # engine reason -> choices the clients saw end
        self.cut_choices = 0
        self.usage: Counter = Counter()
        self.minute = self.new_minute()

    @staticmethod
    def new_minute() -> dict:
        return {"ttft": [], "itl": [], "e2e": [], "done": 0, "errors": 0}

    # ------------------------------------------------------------------ bookkeeping

    def error(self, kind: str, what: str) -> None:
        if what.startswith("http 503"):  # at capacity (--max-queued): expected, the user retries
            self.counts["rejected 503"] += 1
            return
        self.errors[f"{kind}: {what}"] += 1
        self.minute["errors"] += 1

    def done(self, kind: str, reasons: list, usage, n: int, started: float) -> None:
        self.counts[kind] += 1
        self.minute["done"] += 1
        self.minute["e2e"].append(time.monotonic() - started)
        self.finished.update(engine_reason(r) for r in reasons)
        if usage is None:
            return self.error(kind, "no usage")
        usage = usage if isinstance(usage, dict) else usage.model_dump()
        details = usage.get("prompt_tokens_details") or {}
        self.usage["prompt_tokens_x_n"] += usage["prompt_tokens"] * n
        self.usage["completion_tokens"] += usage["completion_tokens"]
        self.usage["cached_tokens_x_n"] += (details.get("cached_tokens") or 0) * n

    def timing(self, started: float, stamps: list[float]) -> None:
        if stamps:
            self.minute["ttft"].append(stamps[0] - started)
            self.minute["itl"] += [b - a for a, b in zip(stamps, stamps[1:])]

    # ------------------------------------------------------------------ requests

    async def sdk_chat(self, kind: str, messages: list, stream: bool, **kw) -> str:
        started = time.monotonic()
        extra = {"priority": kw.pop("priority", 0)}
        n = kw.get("n", 1)
        if not stream:
            answer = await self.sdk.chat.completions.create(
                model=self.model, messages=messages, extra_body=extra, **kw
            )
            self.check_choices(kind, answer.choices, answer.usage, kw)
            self.done(kind, [c.finish_reason for c in answer.choices], answer.usage, n, started)
            return answer.choices[0].message.content or ""
        chunks = await self.sdk.chat.completions.create(
            model=self.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **kw,
        )
        text, stamps, reasons, usage = [], [], {}, None
        async for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.delta.content or choice.delta.tool_calls:
                    stamps.append(time.monotonic())
                    text.append(choice.delta.content or "")
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        self.timing(started, stamps)
        if len(reasons) != n:
            return self.error(kind, "stream without a finish_reason per choice") or ""
        self.check_stop("".join(text), reasons.get(0), kw)
        self.done(kind, list(reasons.values()), usage, n, started)
        return "".join(text)

    def check_choices(self, kind: str, choices, usage, kw: dict) -> None:
        for c in choices:
            self.check_stop(c.message.content or "", c.finish_reason, kw)
            if kw.get("logprobs") and (c.logprobs is None or not c.logprobs.content):
                self.error(kind, "logprobs missing")
            if "response_format" in kw and c.finish_reason == "stop":
                with contextlib.suppress(ValueError):
                    json.loads(c.message.content)
                    continue
                self.error(kind, "json output that does not parse")
            if "tools" in kw and c.finish_reason in ("stop", "tool_calls"):
                calls = c.message.tool_calls or []
                if not calls:
                    self.error(kind, "forced tool choice without a tool call")
                for call in calls:
                    try:
                        json.loads(call.function.arguments)
                    except ValueError:
                        self.error(kind, "tool arguments that do not parse")
        if kw.get("logprobs") and usage is not None:
            counted = sum(len(c.logprobs.content) for c in choices if c.logprobs)
            if counted != usage.completion_tokens:
                self.error(kind, f"logprob entries {counted} != completion_tokens")

    def check_stop(self, text: str, reason: str | None, kw: dict) -> None:
        for stop in kw.get("stop") or ():
            if stop in text:
                self.error("stop", f"output holds its stop string {stop!r}")

    async def raw_stream(self, kind: str, path: str, body: dict, cut_after: int | None) -> None:
        """A streamed chat or completion over aiohttp; ``cut_after``: close after that many
        content chunks (0: before the first, after a random moment)."""
        started = time.monotonic()
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        n = body.get("n", 1)
        stamps, reasons, usage, finished = [], {}, None, False
        async with self.session.post(self.url + path, json=body) as response:
            if response.status != 200:
                await response.read()
                return self.error(kind, f"http {response.status}")
            if cut_after == 0:
                await asyncio.sleep(random.uniform(0.0, 0.5))
                self.counts["cut"] += 1
                self.cut_choices += n
                return response.close()
            async for line in response.content:
                if line.strip() == b"data: [DONE]":
                    finished = True
                    break
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return self.error(kind, f"stream error event {event['error'].get('code')}")
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        stamps.append(time.monotonic())
                    if choice.get("finish_reason"):
                        reasons[choice["index"]] = choice["finish_reason"]
                if cut_after is not None and len(stamps) >= cut_after:
                    self.counts["cut"] += 1
                    # a choice that ended before the cut was counted by the engine as such
                    self.finished.update(engine_reason(r) for r in reasons.values())
                    self.cut_choices += n - len(reasons)
                    return response.close()
        self.timing(started, stamps)
        if not finished:
            return self.error(kind, "stream ended without [DONE]")
        self.done(kind, list(reasons.values()), usage, n, started)

    async def bad(self, rng: random.Random) -> None:
        body, status = rng.choice(BAD_BODIES)
        body = {"model": self.model, **body}
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as response:
            data = await response.json(content_type=None)
        if response.status != status or "error" not in data:
            self.error("bad", f"{body} -> {response.status}, expected {status}")
        self.counts[f"refused {status}"] += 1

    async def one(self, kind: str, rng: random.Random, conversation: list) -> str | None:
        """One request of ``kind``; the answer's text for a conversation turn."""
        priority = rng.choice([-1, 0, 0, 0, 1, 5])
        chat = {"model": self.model, "messages": conversation, "priority": priority}
        if kind == "sdk_stream":
            return await self.sdk_chat(kind, conversation, True, priority=priority)
        if kind == "sdk_plain":
            temperature = rng.choice([0.0, 0.7, 1.0])
            return await self.sdk_chat(
                kind, conversation, False, priority=priority, temperature=temperature
            )
        if kind in ("raw_stream", "cut"):
            cut = rng.choice([0, 1, 4, 16, 64]) if kind == "cut" else None
            await self.raw_stream(kind, "/v1/chat/completions", chat, cut)
        elif kind == "n_logprobs":
            await self.sdk_chat(
                kind, conversation, False, n=2, logprobs=True, top_logprobs=3, temperature=0.8
            )
        elif kind == "stop":
            stop = rng.choice([["ow"], ["ck", "ay"], ["\n"]])
            return await self.sdk_chat(kind, conversation, rng.random() < 0.5, stop=stop)
        elif kind == "json":
            fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY_SCHEMA}}
            await self.sdk_chat(kind, conversation, False, response_format=fmt, max_tokens=64)
        elif kind == "tools":
            choice = rng.choice(
                ["required", {"type": "function", "function": {"name": "get_weather"}}]
            )
            await self.sdk_chat(
                kind, conversation, False, tools=TOOLS, tool_choice=choice, max_tokens=64
            )
        elif kind == "completion":
            body = {"model": self.model, "prompt": self.system + "\nQ: " + rng.choice(QUESTIONS)}
            body.update(max_tokens=64, logprobs=2, priority=priority)
            if rng.random() < 0.5:
                await self.raw_stream(kind, "/v1/completions", body, None)
            else:
                started = time.monotonic()
                async with self.session.post(self.url + "/v1/completions", json=body) as response:
                    data = await response.json(content_type=None)
                if response.status != 200:
                    return self.error(kind, f"http {response.status}")
                reasons = [c["finish_reason"] for c in data["choices"]]
                self.done(kind, reasons, data.get("usage"), 1, started)
        elif kind == "bad":
            await self.bad(rng)
        return None

    async def guarded(self, kind: str, rng: random.Random, conversation: list) -> str | None:
        self.inflight += 1
        try:
            return await asyncio.wait_for(self.one(kind, rng, conversation), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.error(kind, "stuck (no end within the timeout)")
        except openai.APIStatusError as exc:
            self.error(kind, f"http {exc.status_code}: {exc.message[:120]}")
        except (openai.APIError, aiohttp.ClientError) as exc:
            self.error(kind, f"{type(exc).__name__}: {str(exc)[:120]}")
        finally:
            self.inflight -= 1
        return None

    async def user(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        kinds, weights = zip(*WEIGHTS.items())
        conversation: list = []
        while time.monotonic() < until:
            await self.gate.wait()
            if not conversation or len(conversation) > 2 * rng.randint(3, 6):
                conversation = [{"role": "system", "content": self.system}]
            conversation.append({"role": "user", "content": rng.choice(QUESTIONS)})
            kind = rng.choices(kinds, weights)[0]
            answer = await self.guarded(kind, rng, conversation)
            if answer is None:
                conversation.pop()
            else:
                conversation.append({"role": "assistant", "content": answer})
            await asyncio.sleep(rng.uniform(0.0, 1.0))  # the user reads and types

    # ------------------------------------------------------------------ the server side

    async def metrics(self) -> dict:
        async with self.session.get(self.url + "/metrics") as response:
            if response.status != 200:
                self.error("scrape", f"/metrics {response.status}")
            return parse_metrics(await response.text(), self.prefix)

    async def scrapes(self, until: float) -> None:
        rng = random.Random(-1)
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(5, 15))
            try:
                if rng.random() < 0.5:
                    async with self.session.get(self.url + "/health") as response:
                        if response.status != 200:
                            self.error("scrape", f"/health {response.status}")
                else:
                    models = await self.sdk.models.list()
                    if self.model not in [m.id for m in models.data]:
                        self.error("scrape", "/v1/models without the served model")
                self.counts["scrapes"] += 1
            except (openai.APIError, aiohttp.ClientError) as exc:
                self.error("scrape", type(exc).__name__)

    async def until_idle(self, timeout: float = 60.0) -> dict:
        """Waits for the clients' requests to end, then for the gauges to reach 0."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        while True:
            values = await self.metrics()
            gauges = {k: values.get(k) for k in GAUGES_AT_IDLE}
            if not any(gauges.values()) or time.monotonic() > deadline:
                return {**gauges, "inflight": self.inflight}
            await asyncio.sleep(0.5)
