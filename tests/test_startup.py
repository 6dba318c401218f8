"""Start-up cost: what importing and loading pull in, uninitialised model building, zero-copy
weights and the loading progress bar."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import NANBEIGE_TINY, random_tensors, write_checkpoint

from rltserve.models import load_model, loader
from rltserve.models.presets import make_model

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> dict:
    """Runs ``code`` in a fresh interpreter; returns which heavy modules it imported."""
    probe = (
        code
        + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in "
        + "('torch', 'torch._dynamo', 'transformers', 'tokenizers')}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("ouro-tiny", tmp_path_factory.mktemp("startup") / "ouro-tiny")


def test_import_rltserve_imports_no_torch() -> None:
    mods = _modules_after("import rltserve, rltserve.models")
    assert mods == {
        "torch": False,
        "torch._dynamo": False,
        "transformers": False,
        "tokenizers": False,
    }


def test_tokenizer_loads_without_torch_or_transformers(ouro_dir: Path) -> None:
    mods = _modules_after(
        "from rltserve.models.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(ouro_dir)!r})\n"
        "assert tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}])"
    )
    assert mods["tokenizers"] and not mods["torch"] and not mods["transformers"]


def test_demo_path_of_a_built_cache_imports_no_torch(tmp_path: Path) -> None:
    from rltserve.models.demo import demo_model_path

    demo_model_path(tmp_path)  # builds it (imports torch here, in this process)
    mods = _modules_after(
        f"from rltserve.models.demo import demo_model_path\ndemo_model_path({str(tmp_path)!r})"
    )
    assert not mods["torch"]


def test_llm_parent_process_imports_no_torch(ouro_dir: Path) -> None:
    # The spawned stage owns the model; the caller's process only tokenizes and assembles
    # outputs, so it need not pay for importing torch (the server's front end neither).
    mods = _modules_after(
        "from rltserve import LLM, SamplingParams\n"
        "import rltserve.http.server, rltserve.cli\n"
        f"with LLM({str(ouro_dir)!r}) as llm:\n"
        "    out = llm.generate(['Hello'], SamplingParams(max_tokens=2, ignore_eos=True))\n"
        "assert len(out[0].token_ids) == 2"
    )
    assert not mods["torch"] and not mods["transformers"]


def test_load_model_runs_no_initialisation(ouro_dir: Path) -> None:
    # Initialising on the meta device imported torch._dynamo (seconds); building must not.
    mods = _modules_after(f"from rltserve.models import load_model\nload_model({str(ouro_dir)!r})")
    assert mods["torch"] and not mods["torch._dynamo"]


def test_matching_dtype_weights_are_views_of_the_file(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "n", NANBEIGE_TINY, random_tensors(NANBEIGE_TINY))
    model = load_model(path, dtype="float32", progress=False)
    head = model.lm_head.weight
    file_bytes = (path / "model.safetensors").stat().st_size
    # A view of the mapping: its storage is exactly the tensor (no copy was made to a new,
    # separately allocated buffer of the model) and it holds the checkpoint's values.
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        want = f.get_tensor("lm_head.weight")
    assert torch.equal(head, want)
    assert head.untyped_storage().nbytes() == head.numel() * 4 < file_bytes


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_for_large_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_checkpoint(tmp_path / "n", NANBEIGE_TINY, random_tensors(NANBEIGE_TINY), shards=2)
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    load_model(path)  # small, 2 shards: no bar
    assert tty.getvalue() == ""
    monkeypatch.setattr(loader, "PROGRESS_MIN_FILES", 2)
    load_model(path)
    assert "loading weights" in tty.getvalue()
    quiet = _Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    load_model(path, progress=False)
    assert quiet.getvalue() == ""


def test_no_progress_bar_when_stderr_is_not_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_checkpoint(tmp_path / "n", NANBEIGE_TINY, random_tensors(NANBEIGE_TINY))
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    load_model(path)
    assert pipe.getvalue() == ""
    load_model(path, progress=True)  # asked for explicitly
    assert "loading weights" in pipe.getvalue()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_read_concat_equals_cat_of_the_stored_tensors(tmp_path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    from rltserve.models.weight_file import extents, read_concat

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, generator=gen).to(dtype)
    b = torch.randn(4, 5, generator=gen).to(dtype)
    c = torch.randn(1, 5, generator=gen).to(dtype)
    save_file({"a": a, "odd": torch.ones(3, dtype=torch.float64)}, str(tmp_path / "x.safetensors"))
    save_file({"b": b, "c": c}, str(tmp_path / "y.safetensors"))
    places = {**extents(tmp_path / "x.safetensors"), **extents(tmp_path / "y.safetensors")}
    got = read_concat([places["b"], places["a"], places["c"]], dtype)
    assert got.dtype == dtype and torch.equal(got, torch.cat([b, a, c]))
    # A truncated file is an error, not silently short data.
    data = (tmp_path / "y.safetensors").read_bytes()
    (tmp_path / "y.safetensors").write_bytes(data[:-8])
    with pytest.raises(OSError, match="file ends at byte"):
        read_concat([places["b"], places["c"]], dtype)


def test_fused_parameters_read_directly_equal_the_mapped_path(tmp_path: Path) -> None:
    # float32 checkpoint loaded as float32 reads fused q/k/v and gate/up with preadv; as
    # bfloat16 it casts from the mapping. Both hold the checkpoint's values.
    path = write_checkpoint(tmp_path / "n", NANBEIGE_TINY, random_tensors(NANBEIGE_TINY), shards=2)
    direct = load_model(path, dtype="float32", progress=False)
    cast = load_model(path, dtype="bfloat16", progress=False)
    for name, p in direct.state_dict().items():
        assert torch.equal(p.to(torch.bfloat16), cast.state_dict()[name]), name
    layer = direct.model.layers[0]
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})  # noqa: SIM118
    prefix = "model.layers.0.self_attn."
    want = torch.cat([tensors[prefix + f"{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, want)


def test_progress_bar_counts_the_bytes_of_every_loaded_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tqdm

    bars = []

    class Bar:
        def __init__(self, total: int, **kw: object) -> None:
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def update(self, n: int) -> None:
            self.done += n

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    tensors = random_tensors(NANBEIGE_TINY)
    path = write_checkpoint(tmp_path / "n", NANBEIGE_TINY, tensors, shards=2)
    load_model(path, dtype="bfloat16", progress=True)
    (bar,) = bars
    stored = sum(t.numel() * t.element_size() for t in tensors.values())  # float32 bytes
    assert bar.total == stored and bar.done == stored and bar.closed


def test_read_concat_refuses_parts_of_another_size() -> None:
    from rltserve.models.weight_file import Extent, read_concat

    # 3 x 5 bfloat16 values are 30 bytes; read as float32 the result would need 60.
    part = Extent(Path("/nonexistent"), "BF16", (3, 5), 100, 130)
    with pytest.raises(ValueError, match="parts hold 30 bytes, the result 60"):
        read_concat([part], torch.float32)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_direct_reads_leave_no_file_open(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "n", NANBEIGE_TINY, random_tensors(NANBEIGE_TINY), shards=2)
    load_model(path, dtype="float32", progress=False)  # (imports, caches)
    before = len(list(Path("/proc/self/fd").iterdir()))
    load_model(path, dtype="float32", progress=False)
    assert len(list(Path("/proc/self/fd").iterdir())) == before
