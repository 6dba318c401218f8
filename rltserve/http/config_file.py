"""``rltserve serve --config FILE``: vLLM's YAML file of ``serve``'s flags; the other engine
commands (``generate``, ``bench offline``, ``bench rollout``) take one of their own flags too,
so one deployment's engine settings need not be spelled out again for a benchmark of them.

As ``vllm serve --config config.yaml``: the file maps flag names, spelled with dashes or
underscores (``max-num-seqs`` or ``max_num_seqs``), to values: scalars, ``true``/``false`` for
switches, a list for a flag that takes several values (``served-model-name: [a, b]``) or a
comma-separated one (``allowed-origins: ["*"]``), a mapping for a JSON one
(``override-generation-config: {temperature: 0.5}``). ``model`` names the checkpoint, as the
positional MODEL does. The file's values become the flags' defaults, so a flag given on the
command line wins over the file, wherever it stands. A key that names no flag of ``serve``, or
a value its flag refuses, is a ValueError naming the key and the file before anything starts
(vLLM refuses an unknown key too: a typo must not leave a setting silently at its default), and
so is a value refused later that the file set (``named_file``, which ``cli.main`` applies).
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from pathlib import Path

# Where the file's settings are kept on the parsed flags (destination -> (key, value)): the
# positional MODEL of the command line replaces the file's ``model`` (``http.cli.take_model_tag``),
# as vLLM's does, rather than conflicting with it; and an error about a value the file set
# names the file (``named_file``).
CONFIG_SET = "config_set"
_SWITCHES = (argparse.BooleanOptionalAction, argparse._StoreTrueAction)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """The command's ``--config FILE`` (``cli.main`` applies it: ``apply_config_file``)."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a YAML file of this command's flags, as vLLM's: keys are the flag names (with "
        "dashes or underscores, model for MODEL), values scalars, true/false, lists or "
        "mappings; the command line's flags win over it; an unknown key is an error",
    )


def read_config_file(path: str) -> dict[str, object]:
    """The file's mapping (empty for an empty file); ValueError naming the file for one that
    cannot be read, is not YAML, or holds something else than a mapping."""
    import yaml  # (lazily: only serve --config needs it)

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc})") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({exc})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(
            f"--config {path}: must map flag names to values (as 'port: 8000'), "
            f"not a {type(values).__name__}"
        )
    return values


def config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """The file's values by their flags' destinations, each converted as its flag converts
    the command line's text (``--max-model-len 4k``'s parser, ``--log-level``'s choices)."""
    defaults: dict[str, object] = {}
    found: dict[str, tuple[str, object]] = {}
    for key, value in read_config_file(path).items():
        name = str(key)
        action = _action(parser, name, path)
        if value is None:  # (``key:`` with no value: the flag's default)
            continue
        try:
            converted = _converted(action, value)
            if name.replace("_", "-").startswith("no-"):  # (``--no-enable-prefix-caching``)
                converted = not converted
            defaults[action.dest] = converted
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"--config {path}: {name}: {exc}") from None
        found[action.dest] = (name, converted)
    return {**defaults, CONFIG_SET: found}


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Makes the file's values ``parser``'s defaults (``config_defaults``), under the flags."""
    parser.set_defaults(**config_defaults(parser, path))


def named_file(message: str, args: argparse.Namespace) -> str:
    """``message``, an error about the value of a flag, with the ``--config`` file named where
    that value is the file's (the command line did not replace it): a key's value refused
    once the configs are built (``max_num_seqs=0: ...``, ``--tensor-parallel-size 2: ...``)
    must not send its reader looking for a flag no command line holds."""
    for dest, (key, value) in getattr(args, CONFIG_SET, {}).items():
        flag = "--" + dest.replace("_", "-")
        named = message.startswith((f"{dest}=", f"{flag} ", f"{flag}:"))
        suffix = f" (set by {key!r} in --config {args.config})"
        # (once: ``serve`` names the file, and ``cli.main`` then sees the named message)
        if named and getattr(args, dest, None) == value and not message.endswith(suffix):
            return message + suffix
    return message


def _action(parser: argparse.ArgumentParser, key: str, path: str) -> argparse.Action:
    flags = parser._option_string_actions
    flag = "--" + key.replace("_", "-")
    action = flags.get(flag)
    if action is None or flag in ("--help", "--config"):
        names = sorted({f[2:] for f in flags if f.startswith("--")} - {"help", "config"})
        close = difflib.get_close_matches(flag[2:], names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        command = parser.prog.removeprefix("rltserve ")
        raise ValueError(
            f"--config {path}: unknown key {key!r} ({command} has no {flag} flag{hint})"
        )
    return action


def _converted(action: argparse.Action, value: object) -> object:
    if isinstance(action, _SWITCHES):
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} is not true or false")
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_one(action, item) for item in items]
    if isinstance(value, list):  # (rltserve's list flags take comma-separated values)
        if action.type not in (None, str) or not all(_is_scalar(v) for v in value):
            raise ValueError(f"{value!r}: takes one value, not a list")
        return _one(action, ",".join(map(str, value)))
    return _one(action, value)


def _one(action: argparse.Action, value: object) -> object:
    if isinstance(value, dict):  # (a JSON flag's object: --override-generation-config)
        text = json.dumps(value)
    elif isinstance(value, list):
        raise ValueError(f"{value!r}: a list inside a list")
    else:
        text = str(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except (ValueError, TypeError):  # (argparse's words for a builtin type's refusal)
        kind = getattr(action.type, "__name__", "")
        raise ValueError(f"invalid {kind} value: {value!r}") from None
    choices: Sequence[object] | None = action.choices
    if choices is not None and converted not in choices:
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, choices))}")
    return converted


def _is_scalar(value: object) -> bool:
    return isinstance(value, (str, int, float))
