"""Prompt KV moved engine to engine through a file (``core/kv_transfer.py``): every plane's
blocks arrive bit-exact and are cached under the request's hashes; a file of other weights,
another prompt, a torn or missing file moves nothing and is deleted; a short pool takes the
leading blocks that fit and the rest is computed; a request admitted after an import gives the
oracle's tokens and exit depths; the device type is part of every cache salt."""

from __future__ import annotations

import torch
from engine_util import make_core, oracle_run

from rltserve.core.kv_transfer import import_prompt
from rltserve.core.request import FinishReason
from rltserve.sampling import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _cores(path, decode_blocks: int = 64):
    kw = {"block_size": BS, "kv_policy": "last_exited", "enable_prefix_caching": True}
    return make_core(path, **kw), make_core(path, **kw, num_blocks=decode_blocks)


def _prefill(core, prompt, path) -> int:
    """Runs a one-token request exporting its prompt; the blocks written per plane."""
    core.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), None,
                     ("export", str(path)))  # fmt: skip
    while core.has_work():
        core.step()
    return len(core.kv.cache.lookup(core.make_request(None, prompt, GREEDY).block_hashes, 99))


def test_a_transfer_directory_that_refuses_the_file_costs_one_warning(ckpts, tmp_path, caplog):
    """A full (or missing) transfer directory: no file, one log line (not a traceback per
    request); the decode stage computes the prompt."""
    from rltserve.core.kv_transfer import export_prompt

    core = _cores(ckpts["ouro"])[0]
    prompt = list(range(50, 73))
    _prefill(core, prompt, tmp_path / "first.safetensors")  # (its blocks are cached now)
    request = core.make_request("x", prompt, GREEDY)
    missing = tmp_path / "gone" / "kv.safetensors"
    assert export_prompt(core.kv, core.runner, request, str(missing)) == 0
    assert not missing.exists()
    [record] = [r for r in caplog.records if "not exported" in r.getMessage()]
    assert record.levelname == "WARNING" and record.exc_info is None
    assert export_prompt(core.kv, core.runner, request, str(tmp_path / "kv.safetensors")) > 0


def test_an_aborted_request_exports_nothing(ckpts, tmp_path):
    core = _cores(ckpts["ouro"])[0]
    file = tmp_path / "kv.safetensors"
    core.add_request("p", list(range(50, 73)), GREEDY, None, ("export", str(file)))
    core.abort("p")
    assert not core._exports and not core.has_work()


def test_failing_every_request_drops_their_exports(ckpts, tmp_path):
    core = _cores(ckpts["ouro"])[0]
    file = tmp_path / "kv.safetensors"
    core.add_request("p", list(range(50, 73)), GREEDY, None, ("export", str(file)))
    [update] = core.fail_all("boom")
    assert (update.request_id, update.finish_reason, update.error) == (
        "p",
        FinishReason.ERROR,
        "boom",
    )
    assert not core._exports and not core.has_work() and not file.exists()


def test_import_copies_every_plane_bit_exact(ckpts, tmp_path):
    prefill, decode = _cores(ckpts["ouro"])
    prompt = list(range(50, 73))  # 5 full blocks before the last token
    file = tmp_path / "kv.safetensors"
    assert _prefill(prefill, prompt, file) == 5 and file.exists()
    request = decode.make_request("d", prompt, GREEDY)
    assert import_prompt(decode.kv, decode.runner, request, str(file)) == 5
    assert not file.exists()  # read once, then gone
    src = prefill.kv.cache.lookup(request.block_hashes, 5)
    dst = decode.kv.cache.lookup(request.block_hashes, 5)
    assert len(dst) == 5 and decode.kv.cache.num_evictable_blocks == decode.kv.cache.num_blocks
    for a, b in zip(src, dst):
        for x, y in zip(a.blocks, b.blocks):
            rows = slice(x * BS, (x + 1) * BS), slice(y * BS, (y + 1) * BS)
            assert torch.equal(prefill.runner.kv[:, :, rows[0]], decode.runner.kv[:, :, rows[1]])
    decode.kv.check_no_leaks()


def test_blocks_cached_here_already_are_kept_and_the_rest_lands_after_them(ckpts, tmp_path):
    prefill, decode = _cores(ckpts["ouro"])
    prompt = list(range(50, 73))
    file = tmp_path / "kv.safetensors"
    assert _prefill(prefill, prompt, file) == 5
    assert _prefill(decode, prompt[:9], tmp_path / "unused.safetensors") == 2  # computed here
    request = decode.make_request("d", prompt, GREEDY)
    mine = [entry.blocks for entry in decode.kv.cache.lookup(request.block_hashes, 2)]
    assert import_prompt(decode.kv, decode.runner, request, str(file)) == 5
    src = prefill.kv.cache.lookup(request.block_hashes, 5)
    dst = decode.kv.cache.lookup(request.block_hashes, 5)
    assert [entry.blocks for entry in dst[:2]] == mine
    for a, b in zip(src[2:], dst[2:], strict=True):  # the file's third to fifth blocks
        for x, y in zip(a.blocks, b.blocks, strict=True):
            rows = slice(x * BS, (x + 1) * BS), slice(y * BS, (y + 1) * BS)
            assert torch.equal(prefill.runner.kv[:, :, rows[0]], decode.runner.kv[:, :, rows[1]])
    decode.kv.check_no_leaks()


def test_a_file_that_does_not_match_moves_nothing(ckpts, tmp_path):
    prefill, decode = _cores(ckpts["ouro"])
    prompt = list(range(50, 73))
    file = tmp_path / "kv.safetensors"
    _prefill(prefill, prompt, file)
    decode.reset_prefix_cache()  # a new weight version: different hashes
    request = decode.make_request("d", prompt, GREEDY)
    assert import_prompt(decode.kv, decode.runner, request, str(file)) == 0
    assert decode.kv.cache.num_blocks == 0 and not file.exists()
    other = decode.make_request("o", list(range(51, 74)), GREEDY)  # another prompt
    _prefill(prefill, prompt, file)
    assert import_prompt(decode.kv, decode.runner, other, str(file)) == 0
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    assert import_prompt(decode.kv, decode.runner, request, str(torn)) == 0
    assert not torn.exists()
    assert import_prompt(decode.kv, decode.runner, request, str(tmp_path / "missing")) == 0
    decode.kv.check_no_leaks()


def test_a_short_pool_takes_what_fits_and_the_rest_is_computed(ckpts, ouro_ref, tmp_path):
    prefill, decode = _cores(ckpts["ouro"], decode_blocks=32)
    prompt = list(range(50, 73))
    file = tmp_path / "kv.safetensors"
    _prefill(prefill, prompt, file)
    planes = len(decode.kv.planes_of(decode.spec.num_loops))
    decode.kv.allocate("hog", 32 // planes * BS - 3 * BS, decode.spec.num_loops)
    request = decode.make_request("d", prompt, GREEDY)
    assert import_prompt(decode.kv, decode.runner, request, str(file)) == 3  # what was left
    decode.kv.check_no_leaks()
    decode.kv.free("hog")
    decode.add_request("d", prompt, GREEDY)
    tokens = [
        t for _ in range(100) if decode.has_work() for u in decode.step() for t in u.new_token_ids
    ]
    want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited")
    assert tokens == want.tokens and decode.stats().prefix_cache_hits == 3 * BS
    decode.kv.check_no_leaks()


def test_engine_add_with_import_matches_the_oracle(ckpts, ouro_ref, tmp_path):
    """The decode stage hits the moved blocks, but they were computed (on the prefill stage):
    they count as transferred, not as reused. A repeat of the prompt, which the prefill stage
    finds in its own cache, reports that reuse."""
    prefill, decode = _cores(ckpts["ouro"])
    prompt = list(range(50, 73))
    file = tmp_path / "kv.safetensors"
    want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited")
    for rid, cached in (("d", 0), ("again", 20)):
        _prefill(prefill, prompt, file)
        assert prefill.stats().prefix_cache_hits == cached  # (its one-token request's)
        decode.add_request(rid, prompt, GREEDY, None, ("import", str(file)))
        tokens, depths, reported = [], [], []
        while decode.has_work():
            for u in decode.step():
                tokens += u.new_token_ids
                depths += u.new_exit_depths
                reported += [u.num_cached_tokens] if u.num_cached_tokens is not None else []
        assert (tokens, depths) == (want.tokens, want.exit_depths)
        assert reported == [cached]
    stats = decode.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * 23, 20)
    assert stats.kv_transfer_hits == 20  # the first request's; the second's were reused
    decode.kv.check_no_leaks()


def test_the_device_type_is_part_of_every_cache_salt(ckpts):
    """KV computed on another kind of device has other bits: it never matches."""
    core = make_core(ckpts["ouro"], block_size=BS)
    assert b"'cpu'" in core.make_request(None, list(range(9)), GREEDY).cache_salt


def test_a_shorter_prompt_takes_the_leading_blocks_of_a_longer_ones_file(ckpts, tmp_path):
    prefill, decode = _cores(ckpts["ouro"])
    prompt = list(range(50, 73))
    file = tmp_path / "kv.safetensors"
    assert _prefill(prefill, prompt, file) == 5
    request = decode.make_request("d", prompt[:13], GREEDY)  # 3 full blocks before its last
    assert import_prompt(decode.kv, decode.runner, request, str(file)) == 3
    src = prefill.kv.cache.lookup(request.block_hashes, 3)
    dst = decode.kv.cache.lookup(request.block_hashes, 3)
    assert len(dst) == 3 and decode.kv.cache.num_entries == 3
    for a, b in zip(src, dst, strict=True):
        for x, y in zip(a.blocks, b.blocks, strict=True):
            rows = slice(x * BS, (x + 1) * BS), slice(y * BS, (y + 1) * BS)
            assert torch.equal(prefill.runner.kv[:, :, rows[0]], decode.runner.kv[:, :, rows[1]])
    decode.kv.check_no_leaks()


def test_a_file_of_another_dtype_or_for_a_prompt_scoring_request_moves_nothing(ckpts, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    prefill, decode = _cores(ckpts["ouro"])
    prompt = list(range(50, 73))
    file = tmp_path / "kv.safetensors"
    _prefill(prefill, prompt, file)
    with safe_open(str(file), "pt") as f:
        metadata, data = f.metadata(), f.get_tensor("kv")
    request = decode.make_request("d", prompt, GREEDY)
    save_file({"kv": data.double()}, str(file), metadata=metadata)  # right hashes and shape
    assert import_prompt(decode.kv, decode.runner, request, str(file)) == 0
    assert decode.kv.cache.num_blocks == 0 and not file.exists()
    # A request that scores its prompt computes every position: it takes no prompt KV.
    save_file({"kv": data}, str(file), metadata=metadata)
    scoring = decode.make_request("s", prompt, GREEDY.replace(prompt_logprobs=1))
    assert import_prompt(decode.kv, decode.runner, scoring, str(file)) == 0
    assert decode.kv.cache.num_blocks == 0 and not file.exists()
    decode.kv.check_no_leaks()


def test_a_burst_of_imports_larger_than_the_pool_uses_every_file(ckpts, ouro_ref, tmp_path):
    """More moved prompts than the decode pool holds at once: each file is read when its
    request is admitted (blocks reserved first), not when it is added, so none is evicted
    unused; outputs equal the oracle's."""
    prefill, decode = _cores(ckpts["ouro"], decode_blocks=48)
    prompts = [[100 + 7 * i + j for j in range(23)] for i in range(6)]
    for i, prompt in enumerate(prompts):
        file = str(tmp_path / f"{i}.safetensors")
        _prefill(prefill, prompt, file)
        decode.add_request(f"d{i}", prompt, GREEDY, None, ("import", file))
    tokens: dict[str, list[int]] = {f"d{i}": [] for i in range(6)}
    while decode.has_work():
        for u in decode.step():
            tokens[u.request_id] += u.new_token_ids
    for i, prompt in enumerate(prompts):
        want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited")
        assert tokens[f"d{i}"] == want.tokens
    stats = decode.stats()
    assert stats.kv_transfer_hits == 6 * 20 and stats.kv_transfer_unused == 0
    assert not list(tmp_path.iterdir())
    decode.kv.check_no_leaks()


def test_moved_prompt_tokens_no_hit_used_count_as_unused(ckpts, tmp_path):
    """``kv_transfer_unused``: a file that matches nothing (another weight version) and one
    whose request is aborted before admission read it: each its prompt's moved tokens."""
    prefill, decode = _cores(ckpts["ouro"])
    prompt = list(range(50, 73))  # 5 moved blocks: 20 tokens
    stale, pending = tmp_path / "stale.safetensors", tmp_path / "pending.safetensors"
    _prefill(prefill, prompt, stale)
    decode.reset_prefix_cache()  # a new weight version: the file's hashes match nothing
    decode.add_request("stale", prompt, GREEDY, None, ("import", str(stale)))
    while decode.has_work():
        decode.step()
    assert not stale.exists()  # (read at admission)
    stats = decode.stats()
    assert (stats.kv_transfer_hits, stats.kv_transfer_unused) == (0, 20)
    _prefill(prefill, [t + 1 for t in prompt], pending)
    decode.add_request("pending", [t + 1 for t in prompt], GREEDY, None, ("import", str(pending)))
    decode.abort("pending")
    assert pending.exists()  # (never read: the stage client that named it removes it)
    assert decode.stats().kv_transfer_unused == 40
    decode.kv.check_no_leaks()
