"""Structured outputs at a checkpoint's vocabulary size: what each cost is, as JSON on stdout.

    python scripts/bench_structured.py --tokenizer DIR [--tokenizer DIR ...] [--rows 32]
        [--steps 200] [--requests 8]

Per tokenizer (a checkpoint directory; ``--make-vocab 49152 65536 166144 --workdir DIR``
writes Ouro-layout byte-level BPE tokenizers of those sizes there first, locally trained):

- ``vocabulary_s``: building the vocabulary outlines-core takes (once per front end);
- per constraint kind (a six-field JSON schema, ``json_object``, a regex, a choice of 10):
  ``compile_s``, the index's ``pickle_mb``, ``pickle_s`` and ``unpickle_s``, and
  ``channel_mb``: the bytes ``--requests`` requests with that constraint put on a worker's
  channel (``WorkerProcess.send``'s pickling);
- ``step``: ``--rows`` rows of random logits sampled (temperature 1, seeded) for ``--steps``
  steps under a JSON schema with one free string field (each row advancing its own guide), and
  unguided: mean step seconds of each, the mask cache's misses, hit rate, mean seconds per
  miss and bytes held; ``largest_state``: one miss at that schema's free-string state (the
  most ids allowed). One torch thread.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import torch

from rltserve.core.guide import Guide
from rltserve.core.sampler import Sampler, SampleRow, SeededGenerator
from rltserve.guide_index import GuideCompiler, with_index
from rltserve.models.tokenizer import load_tokenizer
from rltserve.sampling import SamplingParams
from rltserve.structured import StructuredOutputsParams

FIELDS = {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "height": {"type": "number"},
    "member": {"type": "boolean"},
    "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
}
KINDS = {
    "json": StructuredOutputsParams(
        json={"type": "object", "properties": FIELDS, "required": list(FIELDS)}
    ),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"\(?[0-9]{3}\)?-[0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutputsParams(choice=[f"answer number {i}" for i in range(10)]),
}
FREE_TEXT = StructuredOutputsParams(
    json={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
)


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def channel_bytes(params: SamplingParams, requests: int) -> int:
    """What ``requests`` adds with ``params`` put on one worker channel."""
    try:
        from rltserve.core.guide_registry import GuidePickler
    except ImportError:  # (before: each message pickled in full)
        from multiprocessing.reduction import ForkingPickler

        dumps = ForkingPickler.dumps
    else:
        dumps = GuidePickler().dumps
    return sum(len(dumps(("add", f"r{i}", [1, 2, 3], params))) for i in range(requests))


def kinds(compiler: GuideCompiler, requests: int) -> dict:
    out = {}
    for kind, structured in KINDS.items():
        index, compile_s = _timed(compiler.compile, structured.pattern(), kind)
        data, pickle_s = _timed(pickle.dumps, index)
        _, unpickle_s = _timed(pickle.loads, data)
        params = SamplingParams(structured_outputs=with_index(structured, index))
        out[kind] = {
            "compile_s": round(compile_s, 3),
            "pickle_mb": round(len(data) / 1e6, 3),
            "pickle_s": round(pickle_s, 4),
            "unpickle_s": round(unpickle_s, 4),
            "channel_mb": round(channel_bytes(params, requests) / 1e6, 3),
        }
    return out


def step(compiler: GuideCompiler, vocab: int, rows: int, steps: int, guided: bool) -> dict:
    index = compiler.compile(FREE_TEXT.pattern())
    sampler = Sampler()
    masks = sampler.guide_masks
    lookups, misses, miss_s = 0, 0, 0.0
    build = masks.mask

    def timed_mask(guide, width, device):
        nonlocal lookups, misses, miss_s
        hit = _key(guide, width) in masks._masks
        mask, took = _timed(build, guide, width, device)
        lookups += 1
        if not hit:
            misses, miss_s = misses + 1, miss_s + took
        return mask

    masks.mask = timed_mask
    sample_rows = [
        SampleRow(
            SamplingParams(temperature=1.0, seed=i),
            generator=SeededGenerator(i, "cpu"),
            bias=torch.zeros(vocab) if guided else None,
            guide=Guide(index) if guided else None,
        )
        for i in range(rows)
    ]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    total = 0.0
    for _ in range(steps):
        out, took = _timed(sampler.sample, logits, sample_rows)
        total += took
        for row, token in zip(sample_rows, out.token_ids):
            if row.guide is not None:
                row.guide.advance(token)
    held = sum(m.numel() * m.element_size() for m in masks._masks.values())
    return {
        "step_s": round(total / steps, 4),
        "mask_misses": misses,
        "mask_hit_rate": round(1 - misses / lookups, 4) if lookups else None,
        "miss_s": round(miss_s / misses, 5) if misses else None,
        "mask_cache_mb": round(held / 1e6, 2),
    }


def largest_state(compiler: GuideCompiler, vocab: int) -> dict:
    """A cache miss at the free string's state (the most ids allowed), reached by a path of
    allowed tokens."""
    index = compiler.compile(FREE_TEXT.pattern())
    transitions = index.index.get_transitions()
    paths, queue = {index.index.get_initial_state(): []}, [index.index.get_initial_state()]
    for state in queue:
        for token, after in transitions.get(state, {}).items():
            if after not in paths:
                paths[after] = [*paths[state], token]
                queue.append(after)
    state = max(paths, key=lambda s: len(transitions.get(s, ())))
    guide = Guide(index).replay(paths[state])
    times = [_timed(Sampler().guide_masks.mask, guide, vocab, torch.device("cpu"))[1]]
    times += [_timed(Sampler().guide_masks.mask, guide, vocab, torch.device("cpu"))[1]]
    return {"allowed": len(transitions[state]), "miss_s": round(min(times), 5)}


def _key(guide, width):
    return (guide.compiled.pattern, guide.compiled.eos, guide.state, width)


def make_tokenizers(sizes: list[int], workdir: Path) -> list[Path]:
    from rltserve.models.preset_configs import ouro_layout
    from rltserve.models.toktrain import write_tokenizer

    dirs = []
    for size in sizes:
        out = workdir / f"tokenizer-{size}"
        if not (out / "tokenizer.json").is_file():
            out.mkdir(parents=True, exist_ok=True)
            write_tokenizer(ouro_layout(size, 2048), out)
        dirs.append(out)
    return dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, action="append", default=[])
    parser.add_argument("--make-vocab", type=int, nargs="*", default=[])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench-structured"))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dirs = args.tokenizer + make_tokenizers(args.make_vocab, args.workdir)
    if not dirs:
        parser.error("give --tokenizer DIR or --make-vocab SIZE")
    report = []
    for path in dirs:
        tokenizer = load_tokenizer(path)
        vocab = len(tokenizer.get_vocab())
        compiler = GuideCompiler(tokenizer)
        _, vocabulary_s = _timed(compiler.compile, "a")
        entry = {"tokenizer": str(path), "vocab": vocab, "vocabulary_s": round(vocabulary_s, 3)}
        entry["kinds"] = kinds(compiler, args.requests)
        entry["largest_state"] = largest_state(compiler, vocab)
        entry["step"] = {
            name: step(compiler, vocab, args.rows, args.steps, guided)
            for name, guided in (("unguided", False), ("guided", True))
        }
        report.append(entry)
        print(json.dumps(entry), file=sys.stderr)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
