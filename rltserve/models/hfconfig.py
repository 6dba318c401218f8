"""Helpers that turn a Hugging Face ``config.json`` dict into a validated, frozen dataclass.

Each family's config class reads raw keys with ``read`` / ``read_ids`` in ``from_dict`` and checks
every field in ``__post_init__`` with the ``check_*`` helpers, so a bad value raises ``ValueError``
naming the family, the field and the value whether the object came from JSON or from code.
Never fall back to the upstream config classes' defaults (MODELS.md §1.2: Ouro's are Qwen values).

The checkpoint's other JSON files are read leniently (``read_json_object``, ``lenient_ids``,
``generation_eos_ids``): a missing or malformed one contributes nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

_MISSING: Any = object()


def bad(family: str, name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{family} config: {name}={value!r}: {why}")


def read(raw: dict[str, Any], family: str, key: str, default: Any = _MISSING) -> Any:
    """``raw[key]``; a missing key is an error unless a default is given."""
    if key in raw:
        return raw[key]
    if default is _MISSING:
        raise ValueError(f"{family} config: required key {key!r} is missing")
    return default


def read_ids(raw: dict[str, Any], family: str, key: str) -> tuple[int, ...]:
    """A token id field that may be null, an int or a list of ints, as a tuple."""
    value = raw.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(family, key, value, "must be null, a non-negative int or a list of them")
    return tuple(values)


def check_model_type(raw: dict[str, Any], family: str) -> None:
    """``model_type`` may be absent (the registry already dispatched) but must not differ."""
    if raw.get("model_type", family) != family:
        raise bad(family, "model_type", raw["model_type"], f"expected {family!r}")


def check_fixed(raw: dict[str, Any], family: str, allowed: dict[str, Any]) -> None:
    """Keys whose only supported value is given (absent keys take that value)."""
    for key, want in allowed.items():
        value = raw.get(key, want)
        if value != want or type(value) is not type(want):
            raise bad(family, key, value, f"only {want!r} is supported")


def check_ints(obj: object, family: str, names: str, minimum: int = 1) -> None:
    """``check_int`` for each space-separated field name."""
    for name in names.split():
        check_int(obj, family, name, minimum)


def check_positives(obj: object, family: str, names: str) -> None:
    for name in names.split():
        check_positive(obj, family, name)


def check_int(obj: object, family: str, name: str, minimum: int = 1) -> None:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(family, name, value, "must be an int")
    if value < minimum:
        raise bad(family, name, value, f"must be >= {minimum}")


def check_positive(obj: object, family: str, name: str) -> None:
    value = getattr(obj, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or math.isnan(value) or math.isinf(value) or value <= 0:
        raise bad(family, name, value, "must be a finite number > 0")


def check_token(obj: object, family: str, name: str, vocab_size: int) -> None:
    value = getattr(obj, name)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
        raise bad(family, name, value, f"must be null or an id in [0, {vocab_size})")


def check_tokens(obj: object, family: str, name: str, vocab_size: int) -> None:
    values = getattr(obj, name)
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab_size:
            raise bad(family, name, values, f"ids must be in [0, {vocab_size})")


def check_decoder(cfg: object, family: str) -> None:
    """Checks shared by the llama-shaped configs (Ouro, Nanbeige): GQA head grouping, an even
    head_dim for RoPE, special token ids inside the vocabulary."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % kv_heads:
        raise bad(
            family, "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}"
        )
    if cfg.head_dim % 2:
        raise bad(family, "head_dim", cfg.head_dim, "must be even (RoPE)")
    check_token(cfg, family, "bos_token_id", cfg.vocab_size)
    check_token(cfg, family, "pad_token_id", cfg.vocab_size)
    check_tokens(cfg, family, "eos_token_ids", cfg.vocab_size)


def read_rope_base(raw: dict[str, Any], family: str, key: str = "rope_theta") -> Any:
    """The RoPE base of plain (unscaled) RoPE, in either config.json form transformers writes.

    transformers < 5 writes a top-level ``rope_theta`` and ``rope_scaling`` (null for plain RoPE);
    transformers 5 writes ``rope_parameters`` (``{"rope_theta": ..., "rope_type": "default"}``)
    and reads ``rope_scaling`` as an alias of it. Either dict means plain RoPE when its
    ``rope_type`` (or legacy ``type``; absent: ``"default"``) is ``"default"`` and it holds no key
    beyond ``rope_theta`` (and a ``partial_rotary_factor`` of 1, as may the top level); any other
    type changes the frequencies or the attention scale and is refused naming it. The base is
    ``raw[key]`` (Huginn names it ``rope_base``), else the dicts' ``rope_theta``; copies that
    disagree are refused rather than one silently winning. Never transformers' class default
    (10000): a config without a base is refused."""
    check_full_rotary(raw.get("partial_rotary_factor"), family)
    found: dict[str, Any] = {}  # where the base was given -> its value
    if key in raw:
        found[key] = raw[key]
    for name in ("rope_scaling", "rope_parameters"):
        params = raw.get(name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise bad(family, name, params, "must be null or a dict")
        kinds = {params[k] for k in ("rope_type", "type") if k in params} or {"default"}
        if kinds != {"default"}:
            kind = ", ".join(repr(k) for k in sorted(kinds, key=str) if k != "default")
            raise bad(family, name, params, f"rope_type {kind} is not supported (only plain RoPE)")
        check_full_rotary(params.get("partial_rotary_factor"), family, f"{name}.")
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if extra:
            raise bad(family, name, params, f"keys {extra} are not supported (only plain RoPE)")
        if "rope_theta" in params:
            found[f"{name}.rope_theta"] = params["rope_theta"]
    if not found:
        raise ValueError(
            f"{family} config: required key {key!r} is missing (and no rope_parameters.rope_theta)"
        )
    (first, value), *others = found.items()
    for where, other in others:
        if other != value:
            raise ValueError(f"{family} config: {first}={value!r} and {where}={other!r} disagree")
    return value


def check_full_rotary(value: object, family: str, where: str = "") -> None:
    """``partial_rotary_factor`` (transformers rotates only that fraction of head_dim) may be
    absent, null or 1; the models here rotate the full head_dim."""
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1
    if not ok:
        why = "only 1.0 is supported (RoPE over the full head_dim)"
        raise bad(family, f"{where}partial_rotary_factor", value, why)


def check_full_attention(family: str, layer_types: object, num_layers: int) -> None:
    """``layer_types`` may be absent; when present every layer must be ``full_attention``."""
    if layer_types is None:
        return
    ok = isinstance(layer_types, list) and all(t == "full_attention" for t in layer_types)
    if not ok or len(layer_types) != num_layers:
        raise bad(family, "layer_types", layer_types, f"must be {num_layers} x 'full_attention'")


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lenient_ids(value: object) -> list[int]:
    """The token ids of an id field (an id or a list); entries that are not ids are dropped."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def generation_eos_ids(folder: Path) -> list[int]:
    """``generation_config.json``'s ``eos_token_id`` in ``folder`` (vLLM stops on them too)."""
    return lenient_ids(read_json_object(folder / "generation_config.json").get("eos_token_id"))
