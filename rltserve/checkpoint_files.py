"""A checkpoint's weight files, looked at before the loader parses them.

The loader (``models.loader``) reports a file it cannot parse as "corrupt or unreadable
safetensors" with the parser's reason, which blames the wrong thing for the files that are
not safetensors at all: an unreadable file, a Hugging Face cache link to a blob whose download
never finished, a Git LFS pointer left by a clone without git-lfs, a file cut short (by an
interrupted download or copy). A directory with PyTorch ``.bin`` weights only, or with
quantized weights, fails there as "no .safetensors" or as a list of unexpected tensors. Each
is named here, from the files' links, modes, sizes and first bytes (and, for a
``quantization_config``, their headers), torch-free; anything else is the loader's.
The other files read (``READ_FILES``: config, tokenizer) are checked for links to nothing,
which a test for the file alone takes for a missing file.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

from rltserve.preflight import snapshot_repo_id
from rltserve.weights import safetensors_header

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LFS_POINTER = b"version https://git-lfs"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Tensors quantization methods store beside (or instead of) a weight: fp8 and compressed-
# tensors scales, GPTQ/AWQ packed weights, bitsandbytes quantization state.
QUANT_TENSORS = (
    "weight_scale",
    "weight_scale_inv",
    "input_scale",
    "weight_zero_point",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "absmax",
    "quant_map",
    "SCB",
)
_SHOWN = 5  # file or tensor names an error lists
# The files beside the weights that the engine or its tokenizer reads when they are there.
READ_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def link_problem(file: Path) -> str | None:
    """Why ``file``, a link whose target does not exist, cannot be read; None for anything
    else. A Hugging Face cache snapshot's files are relative links into ``../../blobs``, so a
    snapshot folder copied without ``-L`` (``cp -r``) holds nothing but such links."""
    if not (file.is_symlink() and not file.exists()):
        return None
    target = Path(os.path.realpath(file))
    if Path(f"{target}.incomplete").exists():
        return (
            f"{file}: its download is incomplete (the blob {target.name}.incomplete in "
            f"{target.parent} is partial); download it again{_fetch_hint(file)}"
        )
    if snapshot_repo_id(file.parent) is not None:
        return (
            f"{file}: a link to the blob {target}, which does not exist (deleted or pruned); "
            f"download it again{_fetch_hint(file)}"
        )
    if target.parent.name == "blobs" and not os.path.isabs(os.readlink(file)):
        return (
            f"{file}: a link to {target}, which does not exist: a Hugging Face cache "
            "snapshot's link, copied without its blob; copy the snapshot with `cp -rL` (the "
            "files, not the links), or name the snapshot in the cache itself"
        )
    return f"{file}: a link to {target}, which does not exist"


def missing_link_targets(root: str | Path) -> str | None:
    """What ``link_problem`` finds among the files of ``READ_FILES`` in ``root`` (files the
    engine or its tokenizer would read, which a test for the file alone takes for absent: "no
    config.json"): the first in full, the others by name; None when there is none."""
    root = Path(root)
    found = [(name, p) for name in READ_FILES if (p := link_problem(root / name)) is not None]
    if not found:
        return None
    others = [name for name, _ in found[1:]]
    return found[0][1] + (f" (so are the links {', '.join(others)})" if others else "")


def weight_file_problem(file: Path) -> str | None:
    """Why ``file`` (a weight file the checkpoint names) cannot be safetensors, or None when
    it may be (a missing plain file, too: the loader names those). Only a regular file is
    opened (a FIFO would block)."""
    if (problem := link_problem(file)) is not None:
        return problem
    if not file.is_file():
        return None
    try:
        with open(file, "rb") as f:
            head = f.read(200)
    except FileNotFoundError:
        return None
    except PermissionError:
        return f"{file}: cannot be read: permission denied ({_mode(file)})"
    except OSError as exc:
        return f"{file}: cannot be read ({exc.strerror or exc})"
    if head.startswith(LFS_POINTER):
        lines = head.decode(errors="replace").splitlines()
        size = next((ln.removeprefix("size ") for ln in lines if ln.startswith("size ")), "")
        real = f" of a {size}-byte file" if size.isdigit() else ""
        return (
            f"{file}: a Git LFS pointer{real}, not the weights (cloned without git-lfs); fetch "
            f"the real weights (`git lfs pull` in the clone){_fetch_hint(file)}"
        )
    return _truncation(file)


def _truncation(file: Path) -> str | None:
    """A file shorter than its safetensors header says (an interrupted download or copy),
    named with both sizes; the parser said "incomplete metadata, file not fully covered" or
    "invalid header length". None when its header does not parse (the loader reports that)
    or the size is right."""
    again = f"(an interrupted download or copy); download or copy it again{_fetch_hint(file)}"
    try:
        size = file.stat().st_size
        if size < 8:
            return f"{file}: truncated: {size} bytes, not even a header's length {again}"
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
        if length > 1 << 40:  # (not a length: garbage, not a cut file)
            return None
        if 8 + length > size:
            return f"{file}: truncated: {size} bytes, within its {8 + length}-byte header {again}"
        header, base = safetensors_header(file)
        want = base + max(
            (e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0
        )
    except Exception:  # (struct, JSON, shape or I/O errors: the loader reports the file)
        return None
    if size >= want:
        return None
    return f"{file}: truncated: {size} bytes of the {want} its header describes {again}"


def check_weight_files(root: str | Path) -> None:
    """``CheckpointError`` for what ``weight_file_problem`` finds in the files the loader
    would read, for ``.bin`` weights without safetensors, and for quantized weights; a
    warning for a ``quantization_config`` beside full-precision weights."""
    from rltserve.models.loader import CheckpointError

    root = Path(root)
    files = _weight_files(root)
    problems = [p for f in files if (p := weight_file_problem(f)) is not None]
    if problems:
        raise CheckpointError("; ".join(problems))
    if not files:
        pickles = sorted(f.name for f in root.glob("*.bin"))
        if pickles:
            shown = _listed(pickles)
            raise CheckpointError(
                f"{str(root)!r} has no .safetensors weight files, only PyTorch .bin files "
                f"({shown}); rltserve loads safetensors only: convert them (transformers' "
                "save_pretrained writes safetensors)"
            )
        return  # (the loader says there are none)
    quantization = _quantization(root)
    if quantization is None:
        return
    method = quantization.get("quant_method")
    quantized = _quantized_tensors(files)
    if quantized:
        shown = _listed(quantized)
        raise CheckpointError(
            f"{root}: a quantized checkpoint (config.json quantization_config: quant_method="
            f"{method!r}; {len(quantized)} quantized tensors: {shown}); quantized checkpoints "
            "are not supported: use the full-precision (float32, bfloat16, float16) one"
        )
    # Full-precision weights load exactly as stored; the config's quantization would only
    # have been applied on loading, and merged or dequantized checkpoints often keep it.
    log.warning(
        "%s: config.json has a quantization_config (quant_method=%r) but the weights are "
        "full precision: they are loaded as stored, unquantized",
        root,
        method,
    )


def _listed(names: list[str]) -> str:
    """The first ``_SHOWN`` names, then "..." for the rest."""
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def _weight_files(root: Path) -> list[Path]:
    """The files the loader reads: the index's shards, else ``model.safetensors``, else every
    ``*.safetensors``; links counted whether or not their target exists."""
    index = root / INDEX_FILE
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names = None  # (no index, or one the loader reports)
    if names is not None:
        return [root / n for n in names if isinstance(n, str)]
    if os.path.lexists(root / SINGLE_FILE):
        return [root / SINGLE_FILE]
    return sorted(root.glob("*.safetensors"))


def _quantization(root: Path) -> dict | None:
    try:
        raw = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None  # (read_config reports it)
    found = raw.get("quantization_config") if isinstance(raw, dict) else None
    return found if isinstance(found, dict) else None


def _quantized_tensors(files: list[Path]) -> list[str]:
    """Tensors stored in a non-float dtype or named as quantization state."""
    found = []
    for file in files:
        try:
            header, _ = safetensors_header(file)
        except Exception:  # (struct, JSON or I/O errors: the loader reports the file)
            continue
        for name, entry in sorted(header.items()):
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            if name == "__metadata__" or dtype is None:
                continue
            if dtype not in FLOAT_DTYPES:
                found.append(f"{name} ({dtype})")
            elif name.rpartition(".")[2] in QUANT_TENSORS:
                found.append(name)
    return found


def _mode(file: Path) -> str:
    try:
        st = file.stat()
    except OSError:
        return "its mode unknown"
    return f"mode {st.st_mode & 0o777:o}, owner uid {st.st_uid}, read as uid {os.geteuid()}"


def _fetch_hint(file: Path) -> str:
    """`` (`hf download ORG/NAME`)`` for a file in a Hugging Face cache snapshot, else ''."""
    repo = snapshot_repo_id(file.parent)
    return f" (`hf download {repo}`)" if repo is not None else ""
