"""Checks of command-line input made before a model loads or a stage starts.

A bad flag then fails at once as a usage error (``ValueError``, exit code 2) instead of as a
failed start seconds later. Only cheap facts are checked here (paths, device presence, name
resolution); whether a checkpoint's contents load is the loader's business.
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
from pathlib import Path

from rltserve.config import DTYPES, EngineConfig

_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def resolve_model(
    model: str,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    name: str = "model",
) -> str:
    """A local checkpoint directory for ``model``: the path itself, or a Hugging Face repo id
    (``org/name``, no such path here) found in the local Hugging Face cache at ``revision``
    (in ``cache_dir``, vLLM's ``download_dir``, when given). Never downloads: a repo id not in
    the cache is a ValueError saying how to fetch it. ``name``: the argument errors name."""
    path = _snapshot(model, revision, cache_dir, name)
    if path != model and not any(Path(path).glob("*.safetensors*")):
        # (what a tokenizer's or a config's download leaves)
        fetch = _fetch(model, revision, cache_dir)
        raise ValueError(f"{name}={model!r}: the local cache holds no weights of it; {fetch}")
    return path


def resolve_tokenizer(
    tokenizer: str,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """A directory with tokenizer files for vLLM's ``tokenizer``: a path, or a repo id found
    in the local Hugging Face cache as ``resolve_model`` finds one (never downloaded)."""
    from rltserve.models.tokenizer import has_tokenizer_files

    path = _snapshot(tokenizer, revision, cache_dir, "tokenizer")
    if not has_tokenizer_files(Path(path)):
        there = "there" if path == tokenizer else f"in its cached snapshot {path}"
        raise ValueError(f"tokenizer={tokenizer!r}: no tokenizer files {there}")
    return path


def snapshot_repo_id(path: str | os.PathLike) -> str | None:
    """``org/name`` for a Hugging Face cache snapshot directory
    (``.../models--org--name/snapshots/<commit>``), else None."""
    p = Path(path)
    repo = p.parent.parent.name
    if p.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/", 1)


def names_checkpoint(text: str) -> bool:
    """Whether ``text`` names a checkpoint ``resolve_model`` would find: an existing path, or
    a Hugging Face repo id in the local cache (never downloaded)."""
    if Path(text).exists():
        return True
    if not _REPO_ID.fullmatch(text):
        return False
    try:
        _snapshot(text, None, None, "model")
    except ValueError:
        return False
    return True


def _snapshot(
    model: str, revision: str | None, cache_dir: str | os.PathLike | None, name: str
) -> str:
    """``model`` itself when it is a path (or cannot be a repo id), else its snapshot in the
    local Hugging Face cache."""
    if Path(model).exists() or not _REPO_ID.fullmatch(model):
        if revision is not None:
            raise ValueError(f"revision={revision!r}: only for a Hugging Face repo id")
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model,
            revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
            local_files_only=True,
        )
    except Exception:  # (not cached, or no huggingface_hub): the same advice
        at = "" if revision is None else f" at revision {revision!r}"
        where = "" if cache_dir is None else f" ({cache_dir})"
        raise ValueError(
            f"{name}={model!r}: no such directory, nor a Hugging Face repo id in the local "
            f"cache{where}{at}; {_fetch(model, revision, cache_dir)}"
        ) from None


def _fetch(model: str, revision: str | None, cache_dir: str | os.PathLike | None) -> str:
    """How to download ``model`` to where it is looked for (huggingface_hub >= 0.34 ships
    the ``hf`` command; only older ones have ``huggingface-cli``, which takes the same
    arguments)."""
    flags = "" if revision is None else f" --revision {revision}"
    flags += "" if cache_dir is None else f" --cache-dir {cache_dir}"
    return (
        f"rltserve never downloads (`hf download {model}{flags}`; "
        "huggingface-cli download on huggingface_hub < 0.34)"
    )


def check_checkpoint_dir(model: str | None, flag: str = "--model") -> None:
    """``model`` names a directory with a config.json (None: the built-in demo model).
    ``flag``: the name the error gives it (the CLI's flag, or ``"model="`` for a keyword)."""
    from rltserve.checkpoint_files import missing_link_targets  # (it imports this module)

    if model is None:
        return
    path = Path(model)
    if not path.exists():
        raise ValueError(f"{_named(flag, model)}: no such checkpoint directory")
    if not path.is_dir():
        raise ValueError(f"{_named(flag, model)}: is a file; pass the checkpoint's directory")
    if (problem := missing_link_targets(path)) is not None:
        raise ValueError(f"{_named(flag, model)}: {problem}")
    if not (path / "config.json").is_file():
        raise ValueError(f"{_named(flag, model)}: has no config.json, so it is not a checkpoint")


def check_device(device: str, flag: str = "--device") -> None:
    """The backend of ``device`` is present (its syntax is ModelConfig's check). Imports torch
    only for a device other than the CPU."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            why = "no CUDA device found" if torch.version.cuda else "torch built without CUDA"
            raise ValueError(f"{_named(flag, device)}: CUDA is not available ({why})")
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise ValueError(f"{_named(flag, device)}: there are {count} CUDA device(s)")
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{_named(flag, device)}: MPS is not available")
    elif kind == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError(f"{_named(flag, device)}: XPU is not available")


# vLLM's names for dtypes beside ours; "auto" is the checkpoint's own (``resolve_dtype``).
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}


def resolve_dtype(dtype: str, model: str | None) -> str:
    """``dtype`` as the engine takes it: ``"auto"`` is the checkpoint's ``torch_dtype`` (or
    ``dtype``) from its config.json when that is one the engine runs, else float32 (also for
    the demo model, ``model=None``); vLLM's ``half`` and ``float`` are float16 and float32; a
    ``torch.dtype`` counts as its name. Any other string is a ValueError listing them all; a
    non-string is returned as given, for the config to check."""
    given = dtype
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        dtype = str(dtype).removeprefix("torch.")  # (torch.bfloat16: vLLM takes one)
    dtype = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
        names = ", ".join([*DTYPES, "auto", *DTYPE_ALIASES])
        raise ValueError(f"dtype={given!r}: must be one of {names}")
    if dtype != "auto":
        return dtype
    try:
        raw = json.loads((Path(model) / "config.json").read_text()) if model else {}
    except (OSError, ValueError):
        raw = {}  # (the checkpoint's own checks say what is wrong with it)
    found = raw.get("torch_dtype") or raw.get("dtype") if isinstance(raw, dict) else None
    if not isinstance(found, str):
        found = None  # (a malformed config's list or dict is no key of DTYPE_ALIASES)
    found = DTYPE_ALIASES.get(found, found)
    return found if found in DTYPES else "float32"


def _named(flag: str, value: str) -> str:
    """``--model DIR`` for a flag, ``model='DIR'`` for a keyword argument (``"model="``)."""
    return f"{flag}{value!r}" if flag.endswith("=") else f"{flag} {value}"


def check_engine(engine_kw: dict) -> EngineConfig:
    """The engine flags build a valid config, name a checkpoint and present devices (the
    prefill stage's too, under ``--disaggregate``)."""
    config = EngineConfig.from_flat(**engine_kw)  # ValueError naming the field
    check_checkpoint_dir(config.model.model)
    check_device(config.model.device)
    if config.execution.prefill_device is not None:
        check_device(config.execution.prefill_device, "--prefill-device")
    return config


def check_output_dir(out: Path, force: bool) -> None:
    """``out`` is a writable directory ``make-model`` may fill: not a file, empty unless
    ``force``. Creates it (as the command would next)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a directory")
    if out.is_dir() and not force and any(out.iterdir()):
        raise ValueError(f"--out {out}: is not empty (use --force to write into it)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create it ({exc.strerror})") from exc
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: is not writable")


def check_tls_files(certfile: str | None, keyfile: str | None) -> None:
    """The certificate and key exist and load as a pair (ServerConfig checks both or none)."""
    if certfile is None or keyfile is None:
        return
    for flag, name in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not Path(name).is_file():
            raise ValueError(f"{flag} {name}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load them ({exc})") from exc


def check_listen_address(host: str, port: int) -> None:
    """``host`` resolves (else ValueError) and ``host:port`` can be bound now (else OSError:
    the port is taken, or needs privileges). Port 0 picks a free port and is not tried."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot be resolved ({exc.strerror})") from exc
    if port == 0:
        return
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the server binds: address reuse on, so a port in TIME_WAIT is not "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
