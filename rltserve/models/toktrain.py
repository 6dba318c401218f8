"""Trains the small byte-level BPE tokenizers that ``make_model`` ships with synthetic checkpoints.

Everything is local and deterministic: a built-in English corpus (plus, for large vocabularies,
pseudo-words drawn from a fixed-seed generator so BPE can reach the requested size) is trained with
the ``tokenizers`` library, then the trained tokens are laid out around special tokens placed at
the ids the real family uses (``TokenizerLayout``). Invariant: the written tokenizer has exactly
``vocab_size`` entries, so every model id decodes; ids the corpus could not fill (only if even the
pseudo-words fall short) are unreachable ``<unused_N>`` vocab entries that still decode.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rltserve.models.corpus import CORPUS

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
HUGINN_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|begin_header|>' + message['role'] + '<|end_header|>\\n\\n' }}"
    "{{ (message['content'] | trim) + '<|end_turn|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerLayout:
    """Where the special tokens sit in a vocabulary of ``vocab_size`` ids.

    ``specials``: (id, content, special) triples; ``special=False`` tokens (``<think>``) survive
    ``skip_special_tokens``. ``bos``/``eos``/``pad``/``unk`` name contents from ``specials``.
    ``wrap_bos_eos``: ``add_special_tokens=True`` yields ``bos text eos`` (Huginn's README strips
    the appended end token); otherwise nothing is added (Ouro's GPT-2 style tokenizer).
    """

    vocab_size: int
    specials: tuple[tuple[int, str, bool], ...]
    bos: str | None
    eos: str | None
    pad: str | None
    unk: str | None
    chat_template: str
    tokenizer_class: str = "PreTrainedTokenizerFast"
    wrap_bos_eos: bool = False
    model_max_length: int = 4096

    def __post_init__(self) -> None:
        ids = [i for i, _, _ in self.specials]
        names = [n for _, n, _ in self.specials]
        if len(set(ids)) != len(ids) or len(set(names)) != len(names):
            raise ValueError("special token ids and contents must be unique")
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"special token ids must lie in [0, {self.vocab_size})")
        if self.vocab_size - len(ids) < 256 + 16:
            raise ValueError(f"vocab_size={self.vocab_size} leaves too few ids for byte-level BPE")
        for role in (self.bos, self.eos, self.pad, self.unk):
            if role is not None and role not in names:
                raise ValueError(f"{role!r} is not one of the special tokens")

    def regular_ids(self) -> list[int]:
        """Ids of trained tokens, in training order: the 256 byte tokens, then the merges."""
        special = {i for i, _, _ in self.specials}
        return [i for i in range(self.vocab_size) if i not in special]

    def word_ids(self) -> list[int]:
        """Ids of merged (multi-byte) tokens: what a trained model mostly emits."""
        return self.regular_ids()[256:]


_ONSETS = tuple(
    ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "w"]
    + ["y", "z", "bl", "br", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sc", "sk"]
    + ["sl", "sm", "sn", "sp", "st", "sw", "tr", "tw", "sh", "ch", "th", "wh"]
)
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ay", "ea", "ee", "ie", "oa", "oo", "ou", "ow", "au")
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "d", "nd", "st", "ng", "rk", "ck", "sh", "x"]
# The built-in corpus alone supports roughly this many byte-level BPE tokens.
_CORPUS_CAPACITY = 1500


def _pseudo_words(count: int) -> list[str]:
    """Deterministic English-looking words; they let BPE reach large vocabularies."""
    rng = random.Random(1234)
    words = []
    for _ in range(count):
        n = rng.randint(2, 4)
        words.append(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n)
            )
        )
    return [" ".join(words[i : i + 100]) for i in range(0, len(words), 100)]


def _train_regular(size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE over the corpus: (tokens in id order, merges in rank order)."""
    lines = CORPUS.splitlines() + _pseudo_words(max(0, size - _CORPUS_CAPACITY))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [
        (a, b) for a, b in (m if isinstance(m, list) else m.split(" ") for m in model["merges"])
    ]
    return sorted(vocab, key=vocab.__getitem__), merges


def build_tokenizer(layout: TokenizerLayout) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` for ``layout`` (deterministic)."""
    free = layout.regular_ids()
    regular, merges = _train_regular(len(free))
    regular += [f"<unused_{i}>" for i in range(len(free) - len(regular))]
    vocab = {content: i for i, content, _ in layout.specials}
    vocab.update(zip(regular, free))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if layout.wrap_bos_eos and layout.bos and layout.eos:
        bos, eos = layout.bos, layout.eos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}",
            pair=f"{bos} $A {eos} $B {eos}",
            special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(c, special=s, normalized=False) for _, c, s in layout.specials]
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    if tok.get_vocab_size() != layout.vocab_size:
        raise AssertionError(f"built {tok.get_vocab_size()} tokens, want {layout.vocab_size}")
    return tok


def write_tokenizer(layout: TokenizerLayout, out_dir: Path) -> None:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    out_dir = Path(out_dir)
    build_tokenizer(layout).save(str(out_dir / "tokenizer.json"))
    roles = {
        "bos_token": layout.bos,
        "eos_token": layout.eos,
        "pad_token": layout.pad,
        "unk_token": layout.unk,
    }
    roles = {k: v for k, v in roles.items() if v is not None}
    extra = [c for _, c, s in layout.specials if s and c not in roles.values()]
    special_map = {**roles, "additional_special_tokens": extra}
    added_decoder = {
        str(i): {
            "content": c,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for i, c, s in sorted(layout.specials)
    }
    config = {
        "tokenizer_class": layout.tokenizer_class,
        "added_tokens_decoder": added_decoder,
        **special_map,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": layout.model_max_length,
        "chat_template": layout.chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
