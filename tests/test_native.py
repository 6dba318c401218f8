"""The native fused SiLU-and-Mul (native/) and its loader (rltserve/native.py).

The invariant under test: the native op returns exactly the torch fallback's numbers,
``F.silu(gate) * up``, bit for bit on CPU wherever the extension reports that it mirrors torch's
expf choice (x86-64 with torch's AVX512, AVX2 or DEFAULT kernels), within 2 ulp elsewhere. The
build runs once per session into the shared cache (a no-op when current: python native/build.py
makes the same files); tests that need it skip when no compiler or ninja is found, or with
RLTSERVE_SKIP_NATIVE_BUILD=1.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from rltserve import native
from rltserve.models import layers

REPO = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ODD_SHAPES = ((3, 2 * 7), (1, 2 * 1), (5, 4, 2 * 33), (2 * 9,), (7, 2 * 37), (2, 3, 1, 2 * 50))
# Past TensorIterator's grain (32768 elements): threads split rows mid-row, as torch does.
SPLIT_SHAPES = ((33, 2 * 1408), (41, 2 * 1000), (1, 2 * 70001), (257, 2 * 555))


def _load_build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rltserve_native_build", REPO / "native/build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ops() -> object:
    """``torch.ops.rltserve_native``, built (once, cached) and loaded into this process."""
    if os.environ.get("RLTSERVE_SKIP_NATIVE_BUILD") == "1":
        pytest.skip("RLTSERVE_SKIP_NATIVE_BUILD=1")
    for var in (native.ENV_ENABLE, native.ENV_FP32):
        if os.environ.get(var, "").strip().lower() in native._OFF:
            pytest.skip(f"{var}={os.environ[var]} in the environment")
    if native._registered_ops() is None:
        build = _load_build_module()
        problem = build.compiler_problem()
        current = build.is_up_to_date(native.library_path(), build.cuda_possible()[0])
        if problem is not None and not current:
            pytest.skip(f"cannot build the native extension: {problem}")
        lib = build.build(cuda="auto")
        if native._registered_ops() is None:
            torch.ops.load_library(str(lib))
    native.reload()
    return torch.ops.rltserve_native


@pytest.fixture
def env():
    """A MonkeyPatch whose changes are undone *before* the loader re-resolves."""
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
    native.reload()


def _mirrors() -> bool:
    return bool(native.backend_info()["cpu_mirrors_torch"])


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    ai = a.float().view(torch.int32).long()
    bi = b.float().view(torch.int32).long()
    return int((ai - bi).abs().max())


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical where the kernel mirrors torch, else the documented tolerance."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if _mirrors():
        assert torch.equal(actual, expected), f"max ulp difference {_ulps(actual, expected)}"
    elif actual.dtype == torch.float32:
        assert _ulps(actual, expected) <= 2
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-6)


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 4).to(dtype)


# --------------------------------------------------------------------------- the build


def test_builds_and_loads(ops) -> None:
    info = native.backend_info()
    assert info["backend"] in ("native-cpu", "native-cuda"), info
    assert info["reason"] is None
    assert {"cpu:bfloat16", "cpu:float16"} <= set(info["enabled"])
    assert info["cpu_kernel"] in ("avx512", "avx2", "scalar")
    if platform.machine() in ("x86_64", "AMD64"):
        assert info["cpu_mirrors_torch"] is True, info
        assert "cpu:float32" in info["enabled"]
        assert info["cpu_kernel"] == {"AVX512": "avx512", "AVX2": "avx2"}.get(
            torch.backends.cpu.get_cpu_capability(), "scalar"
        )


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ODD_SHAPES + SPLIT_SHAPES, ids=str)
def test_fused_equals_fallback(ops, shape, dtype) -> None:
    x = _x(shape, dtype)
    out = ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.is_contiguous()
    assert_same(out, native.torch_silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ((3, 7), (1,), (1000,), (45056,), (33, 1408), (5, 4, 33)))
def test_two_input_equals_fallback(ops, shape, dtype) -> None:
    a, b = _x(shape, dtype, 1), _x(shape, dtype, 2)
    assert_same(ops.silu_mul(a, b), native.torch_silu_mul(a, b))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("row", (65536, 16), ids=("vector-body", "scalar-tail"))
def test_every_16bit_gate_value(ops, dtype, row) -> None:
    """All 2^16 gate values, once through torch's vectorized body and once through its scalar
    remainder (rows shorter than its block): covers every input of the 16-bit tables."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    up = _x((2**16,), dtype, 5)
    x = torch.cat((gate.view(-1, row), up.view(-1, row)), 1)
    out, ref = ops.silu_and_mul(x), native.torch_silu_and_mul(x)
    if _mirrors():
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))  # NaNs too
    else:
        assert_same(out.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(ops, dtype) -> None:
    big = _x((50, 3 * 1000), dtype)
    cases = {
        "row-strided slice": big[:, 7 : 7 + 2000],
        "every third row": big[::3, :2000],
        "transposed (last dim strided)": _x((2000, 60), dtype).t(),
        "permuted leading dims": _x((30, 40, 2 * 500), dtype).transpose(0, 1),
        "expanded rows": _x((1, 2 * 700), dtype).expand(60, -1),
    }
    for name, x in cases.items():
        assert not x.is_contiguous(), name
        out = ops.silu_and_mul(x)
        assert out.is_contiguous(), name
        assert_same(out, native.torch_silu_and_mul(x))
    a = _x((40, 3000), dtype, 3)
    b = _x((3000, 40), dtype, 4).t()
    assert_same(ops.silu_mul(a, b), native.torch_silu_mul(a, b))
    assert_same(ops.silu_mul(b, a), native.torch_silu_mul(b, a))
    assert_same(ops.silu_mul(a[:, :1500], b[:, 100:1600]), F.silu(a[:, :1500]) * b[:, 100:1600])


@pytest.mark.parametrize("shape", ((0, 2 * 8), (4, 0), (2, 0, 6), (0,)))
def test_empty_input(ops, shape) -> None:
    x = torch.empty(shape)
    out = ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.numel() == 0
    assert ops.silu_mul(x, x).shape == x.shape


@pytest.mark.parametrize("threads", (1, 3))
def test_thread_counts(ops, threads) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in DTYPES:
            x = _x((41, 2 * 1000), dtype, threads)
            assert_same(ops.silu_and_mul(x), native.torch_silu_and_mul(x))
    finally:
        torch.set_num_threads(saved)


_CAPABILITY_CHECK = """
import torch
from rltserve import native
info = native.backend_info()
assert info["cpu_mirrors_torch"], info
ops = torch.ops.rltserve_native
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for shape in ((3, 14), (41, 2000), (1, 140002), (5, 4, 66)):
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(dt)
        assert torch.equal(ops.silu_and_mul(x), native.torch_silu_and_mul(x)), (dt, shape)
gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
for dt in (torch.bfloat16, torch.float16):
    for row in (65536, 16):
        x = torch.cat((gate.view(dt).view(-1, row), torch.randn(2**16).to(dt).view(-1, row)), 1)
        a, b = ops.silu_and_mul(x), native.torch_silu_and_mul(x)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (dt, row)
print(info["cpu_kernel"])
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 capabilities")
@pytest.mark.parametrize("capability", ("avx2", "default"))
def test_lower_cpu_capabilities(ops, capability) -> None:
    """torch picks AVX2 / DEFAULT kernels under ATEN_CPU_CAPABILITY; the kernel must follow."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    env[native.ENV_LIB] = str(native.library_path())
    proc = subprocess.run(
        [sys.executable, "-c", _CAPABILITY_CHECK], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == {"avx2": "avx2", "default": "scalar"}[capability]


def test_meta_and_errors(ops) -> None:
    assert ops.silu_and_mul(torch.empty(3, 5, 8, device="meta")).shape == (3, 5, 4)
    assert ops.silu_mul(torch.empty(2, 6, device="meta"), torch.empty(2, 6, device="meta")).shape
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="dtype"):
        ops.silu_and_mul(torch.ones(3, 8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="shapes differ"):
        ops.silu_mul(torch.randn(3, 4), torch.randn(3, 5))


# --------------------------------------------------------------------------- the loader


def test_loader_dispatches_to_native(ops, monkeypatch) -> None:
    native.backend_info()  # resolved: the patched _FUSED is not overwritten
    calls: list[tuple] = []
    real = native._FUSED
    monkeypatch.setattr(native, "_FUSED", lambda x: calls.append(x.shape) or real(x))
    x = _x((4, 2 * 96), torch.bfloat16)
    assert torch.equal(layers.silu_and_mul(x), native.torch_silu_and_mul(x))
    assert calls == [x.shape]
    a, b = _x((6, 10), torch.float32, 1), _x((6, 10), torch.float32, 2)
    assert_same(native.silu_mul(a, b), native.torch_silu_mul(a, b))


def test_requires_grad_goes_to_torch(ops) -> None:
    x = _x((3, 16), torch.float32).requires_grad_()
    out = native.silu_and_mul(x)
    assert out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_fp32_switch(ops, env) -> None:
    env.setenv(native.ENV_FP32, "0")
    info = native.reload()
    assert "cpu:float32" not in info["enabled"] and "cpu:bfloat16" in info["enabled"]
    env.setenv(native.ENV_FP32, "1")
    assert "cpu:float32" in native.reload()["enabled"]


def test_disabled_by_env(env) -> None:
    env.setenv(native.ENV_ENABLE, "0")
    info = native.reload()
    assert info["backend"] == "torch" and native.ENV_ENABLE in info["reason"]
    assert info["enabled"] == []
    for dtype in DTYPES:
        x = _x((5, 4, 2 * 33), dtype)
        assert torch.equal(native.silu_and_mul(x), native.torch_silu_and_mul(x))
        assert torch.equal(layers.silu_and_mul(x), F.silu(x[..., :33]) * x[..., 33:])


def test_not_built_and_stale_reasons(env, tmp_path) -> None:
    env.setattr(native, "_registered_ops", lambda: None)  # as in a fresh process
    env.delenv(native.ENV_ENABLE, raising=False)
    lib = tmp_path / "rltserve_native.so"
    env.setenv(native.ENV_LIB, str(lib))
    info = native.reload()
    assert info["backend"] == "torch" and info["reason"].startswith("not built")
    if native.source_digest() is not None:  # a source checkout: stamps are checked
        lib.write_bytes(b"")
        native.stamp_path(lib).write_text('{"source_digest": "0000"}')
        info = native.reload()
        # (startswith: tmp_path, in every reason, holds the test's name and so "stale")
        assert info["backend"] == "torch" and info["reason"].startswith("stale build")
    lib.write_bytes(b"not a library")
    native.stamp_path(lib).unlink(missing_ok=True)
    info = native.reload()
    assert info["backend"] == "torch" and info["reason"].startswith("load failed")
    x = _x((3, 8), torch.float32)
    assert torch.equal(native.silu_and_mul(x), native.torch_silu_and_mul(x))


def test_import_never_loads() -> None:
    """Importing rltserve (and the models) must not build or load the library."""
    code = (
        "import sys, torch, rltserve.models.layers\n"
        "sys.exit(int(hasattr(torch.ops.rltserve_native, 'silu_mul')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_equals_fallback(ops) -> None:
    if not native.backend_info()["cuda_kernel"]:
        problem = _load_build_module().cuda_possible()
        if not problem[0]:
            pytest.skip(f"extension built without its CUDA kernel: {problem[1]}")
        pytest.fail("a CUDA build was possible but the loaded extension has no CUDA kernel")
    assert native.backend_info()["backend"] == "native-cuda"
    for dtype in DTYPES:
        for shape in ODD_SHAPES + SPLIT_SHAPES + ((128, 2 * 5632), (3, 2 * 11008)):
            x = _x(shape, dtype).cuda()
            out = ops.silu_and_mul(x)
            ref = native.torch_silu_and_mul(x)
            assert torch.equal(out, ref), (dtype, shape, _ulps(out.cpu(), ref.cpu()))
        big = _x((64, 3 * 1000), dtype).cuda()
        for x in (big[:, 8 : 8 + 2000], big[:, 3 : 3 + 2000], big[::3, :2000], big[:, :2000].t()):
            assert torch.equal(ops.silu_and_mul(x), native.torch_silu_and_mul(x)), dtype
        a, b = _x((33, 1408), dtype, 1).cuda(), _x((33, 1408), dtype, 2).cuda()
        assert torch.equal(ops.silu_mul(a, b), native.torch_silu_mul(a, b))
        assert ops.silu_and_mul(torch.empty(0, 8, dtype=dtype, device="cuda")).shape == (0, 4)
    x = _x((32, 2 * 5632), torch.bfloat16).cuda()
    assert torch.equal(native.silu_and_mul(x), native.torch_silu_and_mul(x))


def test_no_compiler_skip_reason(monkeypatch) -> None:
    """Without a compiler the build reports why (the session fixture then skips with it)."""
    build = _load_build_module()
    monkeypatch.setenv("CXX", "definitely-not-a-compiler")
    assert "no C++ compiler" in build.compiler_problem()
    assert shutil.which("definitely-not-a-compiler") is None


def test_a_cuda_torch_without_a_gpu_or_arch_list_builds_the_cpu_kernel(monkeypatch) -> None:
    """A CUDA build of torch and a toolkit on a machine without a GPU: torch has no
    architecture to build for (it fails with an IndexError), so auto builds the CPU kernel
    alone, unless TORCH_CUDA_ARCH_LIST names one."""
    import torch.utils.cpp_extension as cpp

    build = _load_build_module()
    monkeypatch.setattr(build.torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert build.cuda_possible() == (
        False,
        "no GPU visible and no TORCH_CUDA_ARCH_LIST naming one to build for",
    )
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert build.cuda_possible() == (True, "CUDA 13.0, toolkit at /usr/local/cuda")


# --------------------------------------------------------------------------- loader pieces
# (no build needed: pure functions, and dispatch with the loaded ops replaced by recorders)


def test_enabled_pairs_follow_the_mirror_and_the_fp32_switch(monkeypatch) -> None:
    f32 = ("cpu", torch.float32)
    monkeypatch.delenv(native.ENV_FP32, raising=False)
    assert f32 in native._enabled({"mirrors_torch": "1"}, False)[0]
    pairs, notes = native._enabled({"mirrors_torch": "0", "note": "no avx"}, False)
    assert f32 not in pairs and "no avx" in notes[0]
    assert {("cpu", torch.bfloat16), ("cpu", torch.float16)} <= pairs
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv(native.ENV_FP32, off)
        pairs, notes = native._enabled({"mirrors_torch": "1"}, True)
        assert f32 not in pairs and ("cuda", torch.float32) not in pairs, off
        assert ("cuda", torch.bfloat16) in pairs and native.ENV_FP32 in notes[0]
    monkeypatch.setenv(native.ENV_FP32, "yes")
    pairs, notes = native._enabled({"mirrors_torch": "0"}, True)
    assert f32 in pairs and ("cuda", torch.float32) in pairs and notes == ()


def test_parse_info_keeps_equals_signs_in_values() -> None:
    info = native._parse_info("mode=avx2;note=expf=sleef;junk;mirrors_torch=1")
    assert info == {"mode": "avx2", "note": "expf=sleef", "mirrors_torch": "1"}


def test_source_digest_covers_cpp_cu_and_headers_only(tmp_path) -> None:
    assert native.source_digest(tmp_path) is None
    (tmp_path / "a.cpp").write_text("a")
    digests = {native.source_digest(tmp_path)}
    for name in ("b.cu", "c.h"):
        (tmp_path / name).write_text(name)
        digests.add(native.source_digest(tmp_path))
    (tmp_path / "README.md").write_text("not a source")
    assert native.source_digest(tmp_path) in digests and len(digests) == 3


def test_stale_reason_compares_the_stamped_digest(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(native, "source_digest", lambda: "abcd")
    lib = tmp_path / "rltserve_native.so"
    assert native._stale_reason(lib) is None  # no stamp: nothing to compare
    stamp = native.stamp_path(lib)
    stamp.write_text('{"source_digest": "abcd"}')
    assert native._stale_reason(lib) is None
    stamp.write_text('{"source_digest": "0000"}')
    assert "stale build" in native._stale_reason(lib)
    stamp.write_text("{not json")
    assert native._stale_reason(lib) is None


def test_library_path_and_build_tag(monkeypatch, tmp_path) -> None:
    assert f"torch-{torch.__version__}-py{sys.version_info[0]}" in native.build_tag()
    monkeypatch.setenv(native.ENV_LIB, str(tmp_path / "lib.so"))
    assert native.library_path() == tmp_path / "lib.so"
    monkeypatch.delenv(native.ENV_LIB)
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    assert native.library_path() == tmp_path / f"{native.LIB_NAME}.so"


def test_a_library_that_registers_no_ops_selects_torch(env, tmp_path) -> None:
    env.setattr(native, "_registered_ops", lambda: None)
    env.setattr(native, "source_digest", lambda: None)
    env.setattr(torch.ops, "load_library", lambda path: None)
    env.delenv(native.ENV_ENABLE, raising=False)
    lib = tmp_path / "rltserve_native.so"
    lib.write_bytes(b"")
    env.setenv(native.ENV_LIB, str(lib))
    info = native.reload()
    assert info["backend"] == "torch" and "registered no rltserve_native ops" in info["reason"]
    assert info["cpu_mirrors_torch"] is None and info["enabled"] == []


def test_backend_is_native_cuda_only_with_a_visible_gpu(env) -> None:
    state = native._State(True, "lib.so", None, {"mirrors_torch": "1"}, True, frozenset(), ())
    env.setattr(native, "_STATE", state)
    env.setattr(torch.cuda, "is_available", lambda: False)
    info = native.backend_info()
    assert info["backend"] == "native-cpu" and info["cpu_mirrors_torch"] is True
    env.setattr(torch.cuda, "is_available", lambda: True)
    assert native.backend_info()["backend"] == "native-cuda"


@pytest.fixture
def recorded(env) -> list[str]:
    """float32 on CPU "enabled", its native ops replaced by recorders of which one ran."""
    calls: list[str] = []
    state = native._State(True, "lib.so", None, {}, False, frozenset({("cpu", torch.float32)}), ())
    env.setattr(native, "_STATE", state)
    env.setattr(native, "_ENABLED", state.enabled)
    env.setattr(native, "_FUSED", lambda x: calls.append("fused") or native.torch_silu_and_mul(x))
    env.setattr(native, "_PAIR", lambda a, b: calls.append("pair") or native.torch_silu_mul(a, b))
    return calls


def test_dispatch_sends_only_what_the_kernels_take_natively(recorded) -> None:
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    native.silu_and_mul(a)
    native.silu_mul(a, b)
    assert recorded == ["fused", "pair"]
    recorded.clear()
    native.silu_and_mul(a.bfloat16())  # not enabled
    native.silu_mul(a, torch.randn(1, 6))  # broadcasting
    native.silu_mul(a, b.double())  # mixed dtypes
    native.silu_mul(a, b.clone().requires_grad_())  # autograd through b
    native.silu_and_mul(a.clone().requires_grad_())  # autograd through x
    with torch.no_grad():
        native.silu_mul(a, b.clone().requires_grad_())  # no graph: native again
    assert recorded == ["pair"]
