"""Dense reference oracle for looped language models (DESIGN §9).

Written from MODELS.md alone and sharing no code with the engine: it never imports ``rltserve``.
One request at a time, no paging, no batching; every KV policy is expressed directly on dense
per-depth K/V tensors. Engine tests compare token ids, exit depths and logits against it.

Families (by ``config.json`` ``model_type``): ``"ouro"`` (sandwich norms, exit gate),
``"nanbeige"`` (pre-norm llama block, no gate) and ``"huginn_raven"`` (prelude / recurrent core /
coda, interleaved RoPE, boundary KV for prelude and coda layers).

Semantics (what the engine must reproduce):

* Depth of a request: ``D_r = max(D, cap)`` for Ouro, ``D_r = cap`` for gateless families, with
  ``cap = max_loops or D``.
* The prompt runs in one forward per depth over all prompt positions, always all ``D_r`` loops.
  The first output token comes from the last prompt position's exit depth. Decode tokens run one
  at a time; loop ``d`` of a token attends over the plane of depth ``d``.
* KV policies: ``full`` (a plane per depth, exited decode tokens keep looping to ``D_r``),
  ``last_exited`` (a plane per depth, an exited decode token's plane-``e`` K/V is copied into the
  deeper planes), ``shared`` (one plane, overwritten every loop), ``ring:k`` (plane ``(d-1) % k``;
  an exited decode token's K/V is copied into the planes it never wrote, those of depths
  ``e+1..k``).
  Under the last three a decode token stops at its exit depth.
* Huginn coda: the coda input of a position is its state at its own exit depth (prompt positions
  other than the last: depth ``D_r``); the coda K/V of every position lives in one boundary plane.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from reference_parts import (
    EXIT_MODES,
    AttnFn,
    Criterion,
    DenseKV,
    ExitRule,
    RecomputeOutput,
    RefOutput,
    causal_attention,
    choose_token,
    load_checkpoint,
    noise_generator,
    parse_kv_policy,
    plane_of,
    rms_norm,
    rope_half,
    rope_interleaved,
)

FAMILIES = ("ouro", "nanbeige", "huginn_raven")


# --------------------------------------------------------------------------- the oracle


class Reference:
    """Dense oracle over one checkpoint. Build with :meth:`load`."""

    def __init__(self, cfg: dict, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> None:
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"unsupported model_type {family!r}")
        self.cfg = cfg
        self.family = family
        self.dtype = dtype
        self.w = {
            k: v.to(dtype)
            for k, v in tensors.items()
            if k != "freqs_cis" and not k.endswith("rotary_emb.inv_freq")
        }
        if family == "huginn_raven":
            self._init_huginn(cfg)
        else:
            self._init_llama(cfg)
        if "lm_head.weight" not in self.w:  # tied embeddings
            self.w["lm_head.weight"] = self.w[self.embed_name]
        self.scale = 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def load(cls, path: str | Path, dtype=torch.float32) -> Reference:
        cfg, tensors = load_checkpoint(path)
        return cls(cfg, tensors, dtype)

    def _init_llama(self, cfg: dict) -> None:
        self.has_gate = self.family == "ouro"
        self.sandwich = self.family == "ouro"
        self.num_loops = int(cfg["total_ut_steps"] if self.has_gate else cfg["num_loops"])
        self.hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = (
            cfg.get("head_dim") or cfg.get("kv_channels") or self.hidden // self.num_heads
        )
        self.num_core_layers = cfg["num_hidden_layers"]
        self.num_boundary_layers = 0
        self.eps = cfg["rms_norm_eps"]
        self.theta = float(cfg["rope_theta"])
        self.skip_loop_norm = bool(cfg.get("skip_loop_final_norm", False))
        self.embed_name = "model.embed_tokens.weight"

    def _init_huginn(self, cfg: dict) -> None:
        self.has_gate = False
        self.num_loops = int(cfg["mean_recurrence"])
        self.hidden = cfg["n_embd"]
        self.num_heads = cfg["n_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.num_heads
        self.n_prelude = cfg["n_layers_in_prelude"]
        self.n_coda = cfg["n_layers_in_coda"]
        self.num_core_layers = cfg["n_layers_in_recurrent_block"]
        self.num_boundary_layers = self.n_prelude + self.n_coda
        self.eps = cfg["norm_eps"]
        self.rope_base = float(cfg["rope_base"])
        self.embed_scale = float(cfg["init_values"]["embed_scale"])
        self.init_std = float(cfg["init_values"]["std"])
        self.embed_name = "transformer.wte.weight"

    # ------------------------------------------------------------------ llama-style layers

    def _llama_layer(self, h: torch.Tensor, i: int, positions: torch.Tensor, attn: AttnFn):
        w, p, eps = self.w, f"model.layers.{i}.", self.eps
        t = h.shape[0]
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(t, self.num_heads, self.head_dim)
        k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(t, self.num_kv_heads, self.head_dim)
        v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(t, self.num_kv_heads, self.head_dim)
        q = rope_half(q, positions, self.theta)
        k = rope_half(k, positions, self.theta)
        a = attn(i, q, k, v).reshape(t, self.num_heads * self.head_dim)
        a = F.linear(a, w[p + "self_attn.o_proj.weight"])
        if self.sandwich:
            a = rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
        h = h + a
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        m = F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(
            x, w[p + "mlp.up_proj.weight"]
        )
        m = F.linear(m, w[p + "mlp.down_proj.weight"])
        if self.sandwich:
            m = rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
        return h + m

    # ------------------------------------------------------------------ huginn layers

    def _huginn_block(self, x: torch.Tensor, name: str, positions: torch.Tensor, attn: AttnFn, i):
        w, p, eps = self.w, f"transformer.{name}.", self.eps
        t, e = x.shape
        y = rms_norm(x, w[p + "norm_1.weight"], eps)
        qkv = F.linear(y, w[p + "attn.Wqkv.weight"]).view(t, 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.chunk(3, dim=1)
        bias = w[p + "attn.qk_bias"]
        q = rope_interleaved(q + bias[0, 0], positions, self.rope_base)
        k = rope_interleaved(k + bias[1, 0], positions, self.rope_base)
        a = F.linear(attn(i, q, k, v.contiguous()).reshape(t, e), w[p + "attn.proj.weight"])
        x = rms_norm(a + x, w[p + "norm_2.weight"], eps)
        y = rms_norm(x, w[p + "norm_3.weight"], eps)
        gate, up = F.linear(y, w[p + "mlp.fc.weight"]).chunk(2, dim=-1)
        m = F.linear(F.silu(gate) * up, w[p + "mlp.proj.weight"])
        return rms_norm(m + x, w[p + "norm_4.weight"], eps)

    # ------------------------------------------------------------------ pieces of a forward

    def _prelude(self, ids: list[int], start: int, bkv: DenseKV | None) -> torch.Tensor:
        positions = torch.arange(start, start + len(ids))
        x = self.w[self.embed_name][torch.tensor(ids, dtype=torch.long)]
        if self.family != "huginn_raven":
            return x
        x = x * self.embed_scale
        attn = bkv.attn_fn(0, start, self.scale)
        for i in range(self.n_prelude):
            x = self._huginn_block(x, f"prelude.{i}", positions, attn, i)
        return x

    def _initial_state(
        self, e: torch.Tensor, start: int, init_state: str, seed: int | None
    ) -> torch.Tensor:
        if self.family != "huginn_raven":
            return e
        if init_state == "zero":
            return torch.zeros_like(e)
        rows = []
        sd = self.init_std
        for p in range(start, start + e.shape[0]):
            g = noise_generator(seed, p)
            r = torch.nn.init.trunc_normal_(
                torch.empty(self.hidden, dtype=torch.float32),
                mean=0.0,
                std=sd,
                a=-3 * sd,
                b=3 * sd,
                generator=g,
            )
            rows.append(r * self.embed_scale)
        return torch.stack(rows).to(e.dtype)

    def _loop(self, s: torch.Tensor, e: torch.Tensor, start: int, attn: AttnFn) -> torch.Tensor:
        positions = torch.arange(start, start + s.shape[0])
        if self.family == "huginn_raven":
            s = F.linear(torch.cat((s, e), dim=-1), self.w["transformer.adapter.weight"])
            for i in range(self.num_core_layers):
                s = self._huginn_block(s, f"core_block.{i}", positions, attn, i)
            return s
        for i in range(self.num_core_layers):
            s = self._llama_layer(s, i, positions, attn)
        if not self.skip_loop_norm:
            s = rms_norm(s, self.w["model.norm.weight"], self.eps)
        return s

    def _gate(self, s: torch.Tensor) -> torch.Tensor | None:
        """fp32 gate logits [T] of post-loop states, or None."""
        if not self.has_gate:
            return None
        w = self.w["model.early_exit_gate.weight"].float()
        b = self.w["model.early_exit_gate.bias"].float()
        return F.linear(s.float(), w, b)[:, 0]

    def _coda(self, s: torch.Tensor, start: int, bkv: DenseKV | None) -> torch.Tensor:
        """States [T, S] at positions start.. -> fp32 logits [T, V]."""
        if self.family == "huginn_raven":
            positions = torch.arange(start, start + s.shape[0])
            attn = bkv.attn_fn(0, start, self.scale)
            x = rms_norm(s, self.w["transformer.ln_f.weight"], self.eps)
            for i in range(self.n_coda):
                x = self._huginn_block(x, f"coda.{i}", positions, attn, self.n_prelude + i)
            s = rms_norm(x, self.w["transformer.ln_f.weight"], self.eps)
        elif self.skip_loop_norm:
            s = rms_norm(s, self.w["model.norm.weight"], self.eps)
        return F.linear(s, self.w["lm_head.weight"]).float()

    # ------------------------------------------------------------------ public API

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation by default: config.json's ``eos_token_id`` (an int or a list)
        and, for Ouro, ``<|endoftext|>`` = 0 and ``<|im_end|>`` = 2 (MODELS.md: the chat eos
        is 2 while the config says 0); ids outside the vocabulary are dropped."""
        raw = self.cfg.get("eos_token_id")
        ids = [] if raw is None else list(raw) if isinstance(raw, list) else [raw]
        if self.family == "ouro":
            ids = [0, 2] + ids
        vocab = self.w["lm_head.weight"].shape[0]
        return tuple(dict.fromkeys(i for i in ids if i < vocab))

    def depths(self, max_loops: int | None) -> tuple[int, int]:
        """-> (cap, D_r) for a request's max_loops."""
        cap = self.num_loops if max_loops is None else max_loops
        if cap < 1:
            raise ValueError("max_loops must be >= 1")
        depth = max(self.num_loops, cap) if self.has_gate else cap
        return cap, depth

    def _new_caches(self, planes: int, max_len: int) -> tuple[DenseKV, DenseKV | None]:
        kv = DenseKV(
            planes, self.num_core_layers, max_len, self.num_kv_heads, self.head_dim, self.dtype
        )
        bkv = None
        if self.num_boundary_layers:
            bkv = DenseKV(
                1, self.num_boundary_layers, max_len, self.num_kv_heads, self.head_dim, self.dtype
            )
        return kv, bkv

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        kv_policy: str = "full",
        exit_mode: str = "gate",
        min_loops: int = 1,
        max_loops: int | None = None,
        exit_threshold: float = 1.0,
        exit_criterion: str | None = None,
        trace_depths: list[int] | None = None,
        init_state: str = "zero",
        seed: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
        eos_token_ids: tuple[int, ...] = (),
        min_tokens: int = 0,
        logit_bias: dict[int, float] | None = None,
        allowed_token_ids: tuple[int, ...] | None = None,
        prompt_chunks: list[int] | None = None,
        steer=None,
    ) -> RefOutput:
        """Greedy generation of one request; see the module docstring for the semantics.

        Generation stops after a token in ``stop_token_ids`` or ``eos_token_ids`` once at least
        ``min_tokens`` tokens exist (the stopping token included), or after ``max_tokens``.
        Until ``min_tokens`` tokens exist those ids are not chosen (vLLM's rule): the earliest
        stop is token ``min_tokens + 1``. The choice adds ``logit_bias`` and is made among
        ``allowed_token_ids`` (when given). ``logits`` are kept as the model gave them.
        Without a gate, ``exit_threshold < 1`` exits decode tokens by ``exit_criterion``
        (``Criterion``; "kl" when None); the prompt runs all its loops. ``prompt_chunks``
        (the prompt's chunk starts, 0 first) runs the prompt chunk by chunk, each through
        every loop before the next: under ``shared`` and ``ring`` a later chunk then reads an
        earlier one's last versions (under the other policies chunking changes nothing).
        ``steer`` (``reference_guided``) sees the output before each token: ``forced(tokens)``,
        an id output unchosen (never a stop) by a position run through all D_r loops, which
        records D_r (bounded thinking); ``allowed(tokens)``, the ids a constraint leaves."""
        if not prompt:
            raise ValueError("empty prompt")
        if exit_mode not in EXIT_MODES:
            raise ValueError(f"unknown exit_mode {exit_mode!r}")
        if min_loops < 1:
            raise ValueError("min_loops must be >= 1")
        if init_state not in ("zero", "random"):
            raise ValueError(f"unknown init_state {init_state!r}")
        if init_state == "random" and self.family == "huginn_raven" and seed is None:
            raise ValueError("init_state='random' needs a seed")
        cap, depth = self.depths(max_loops)
        kind, planes = parse_kv_policy(kv_policy, depth)
        out = RefOutput()
        if max_tokens <= 0:
            return out

        def rule_for(k: int) -> ExitRule:
            trace = None
            if exit_mode == "trace":
                if trace_depths is None or k >= len(trace_depths):
                    raise ValueError(f"trace_depths has no entry for output token {k}")
                trace = trace_depths[k]
            return ExitRule(
                exit_mode,
                cap,
                min_loops=min_loops,
                exit_threshold=exit_threshold,
                trace_depth=trace,
            )

        def emit(rule: ExitRule, exit_d: int, logits: torch.Tensor, force: int | None) -> bool:
            narrowed = steer.allowed(out.tokens) if steer is not None else None
            allowed = allowed_token_ids if narrowed is None else narrowed
            stop_ids = (*stop_token_ids, *eos_token_ids)
            banned = stop_ids if len(out.tokens) < min_tokens else ()
            tok = force
            if force is None:
                tok = choose_token(logits, allowed=allowed, logit_bias=logit_bias, banned=banned)
            out.tokens.append(tok)
            out.exit_depths.append(exit_d)
            out.logits.append(logits)
            out.gate_logits.append(rule.gate_logits)
            out.cdfs.append(rule.cdfs)
            stops = force is None and len(out.tokens) >= min_tokens and tok in stop_ids
            return stops or len(out.tokens) >= max_tokens

        n = len(prompt)
        kv, bkv = self._new_caches(planes, n + max_tokens)
        adaptive = exit_criterion != "none" and (exit_threshold < 1.0 or exit_criterion is not None)
        zero_shot = not self.has_gate and adaptive and exit_mode != "trace"

        # Prompt: one forward per depth over all positions of a chunk (the whole prompt
        # unless ``prompt_chunks``), always all D_r loops.
        starts = list(prompt_chunks or [0])
        if starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= n:
            raise ValueError(f"prompt_chunks={prompt_chunks!r}: not chunk starts of the prompt")
        rule, force = rule_for(0), steer and steer.forced(out.tokens)
        decide = rule.update if force is None else lambda t, _: t == depth  # (forced: D_r)
        prompt_logits = []
        for start, end in zip(starts, starts[1:] + [n]):
            e = self._prelude(list(prompt[start:end]), start, bkv)
            s = self._initial_state(e, start, init_state, seed)
            exit_d, exit_state = None, None
            last = end == n
            for d in range(1, depth + 1):
                attn = kv.attn_fn(plane_of(kind, planes, d), start, self.scale)
                s = self._loop(s, e, start, attn)
                g = self._gate(s[-1:])
                if last and exit_d is None and decide(d, None if g is None else g[0]):
                    exit_d, exit_state = d, s[-1:].clone()
                if d == cap:
                    at_cap = s.clone() if not last else s[:-1].clone()
            if self.family == "huginn_raven":  # (the coda writes every position's coda K/V)
                every = self._coda(s if not last else torch.cat((s[:-1], exit_state)), start, bkv)
                prompt_logits.append(every if not last else every[:-1])  # (cap == depth)
                if last:
                    logits = every[-1]
            else:
                prompt_logits.append(self._coda(at_cap, start, bkv))
                if last:
                    logits = self._coda(exit_state, start, bkv)[-1]
        out.prompt_logits = torch.cat(prompt_logits)
        if emit(rule, exit_d, logits, force):
            return out

        # Decode: one token at a time.
        while True:
            k = len(out.tokens)
            pos = n + k - 1
            e = self._prelude([out.tokens[-1]], pos, bkv)
            s = self._initial_state(e, pos, init_state, seed)
            rule, force = rule_for(k), steer and steer.forced(out.tokens)
            exit_d, exit_state, crit = None, None, None
            if zero_shot:
                vocab = self.w["lm_head.weight"].shape[0]
                crit = Criterion(exit_criterion or "kl", exit_threshold, vocab, s)
            for d in range(1, depth + 1):
                s = self._loop(s, e, pos, kv.attn_fn(plane_of(kind, planes, d), pos, self.scale))
                if force is not None and d == depth:
                    exit_d, exit_state = d, s
                if exit_d is None and force is None:
                    g = self._gate(s)
                    below = None
                    if crit is not None:  # (its coda writes the position's coda K/V, as HF's)
                        logits = self._coda(s, pos, bkv) if crit.name in crit.NEEDS_LOGITS else None
                        below = crit.below(s, logits)
                    if rule.update(d, None if g is None else g[0], below):
                        exit_d, exit_state = d, s
                        if kind != "full":
                            break
            if kind == "last_exited" and exit_d < depth:
                kv.copy_position(exit_d - 1, range(exit_d, depth), pos)
            elif kind == "ring" and exit_d < min(planes, depth):
                # Planes it never wrote get its exit version (a deeper loop's plane it did
                # write keeps its own): nothing stale is ever read.
                kv.copy_position(exit_d - 1, range(exit_d, min(planes, depth)), pos)
            if emit(rule, exit_d, self._coda(exit_state, pos, bkv)[0], force):
                return out

    @torch.no_grad()
    def full_recompute(
        self,
        tokens: list[int],
        exit_depths: list[int] | None = None,
        *,
        prompt_len: int | None = None,
        kv_policy: str = "full",
        max_loops: int | None = None,
        init_state: str = "zero",
        seed: int | None = None,
    ) -> RecomputeOutput:
        """One dense forward per depth over the whole sequence (every position at all D_r loops,
        causal attention over plane d).

        ``exit_depths[p]``: the exit depth of position p (default: the cap); it selects the output
        logits and, for Huginn, the coda input. ``kv_policy="last_exited"`` replaces, at every
        depth d > e_p, the K/V of each decode position p (``p >= prompt_len``) by its depth-e_p
        K/V, which is the last_exited policy written as a whole-sequence computation.
        """
        cap, depth = self.depths(max_loops)
        t = len(tokens)
        if exit_depths is None:
            exit_depths = [cap] * t
        if len(exit_depths) != t:
            raise ValueError("exit_depths must have one entry per position")
        if kv_policy not in ("full", "last_exited"):
            raise ValueError("full_recompute supports kv_policy 'full' and 'last_exited'")
        if prompt_len is None:
            prompt_len = t
        ex = torch.tensor(exit_depths, dtype=torch.long)
        kv_depth = ex.clone()
        kv_depth[:prompt_len] = depth
        if kv_policy == "full":
            kv_depth[:] = depth

        _, bkv = self._new_caches(1, t)
        saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # [depth][layer] -> (k, v)

        def make_attn(d: int) -> AttnFn:
            saved.append([])

            def fn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                stale = kv_depth < d
                if bool(stale.any()):
                    src = kv_depth.clamp(max=d - 1) - 1
                    idx = torch.arange(t)
                    ks = torch.stack([saved[j][layer][0] for j in range(d - 1)])[src, idx]
                    vs = torch.stack([saved[j][layer][1] for j in range(d - 1)])[src, idx]
                    k = torch.where(stale[:, None, None], ks, k)
                    v = torch.where(stale[:, None, None], vs, v)
                saved[d - 1].append((k, v))
                return causal_attention(q, k, v, 0, self.scale)

            return fn

        e = self._prelude(list(tokens), 0, bkv)
        s = self._initial_state(e, 0, init_state, seed)
        states, gates = [], []
        for d in range(1, depth + 1):
            s = self._loop(s, e, 0, make_attn(d))
            states.append(s)
            g = self._gate(s)
            if g is not None:
                gates.append(g)
        stacked = torch.stack(states)  # [D_r, T, S]
        exit_states = stacked[ex - 1, torch.arange(t)]
        gate_logits = torch.stack(gates) if gates else None
        if self.family == "huginn_raven":
            return RecomputeOutput(self._coda(exit_states, 0, bkv), None, gate_logits)
        depth_logits = torch.stack([self._coda(x, 0, None) for x in states])
        return RecomputeOutput(depth_logits[ex - 1, torch.arange(t)], depth_logits, gate_logits)
