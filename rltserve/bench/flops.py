"""The FLOP bound of early exit (DESIGN §10), ``(F0 + D*Fr) / (F0 + mean_exit_depth*Fr)``, and
where it does not measure the run: under ``kv_policy=full`` a token that exits keeps looping to
the full depth (DESIGN §4), so nothing is saved and the bound is 1; a zero-shot criterion that
runs the coda and the head at every loop (``HEAD_PER_LOOP``) spends F0's coda and head once per
loop, not once per token, which the formula does not count, so there is no bound (None, with
the reason in ``flop_bound_note``)."""

from __future__ import annotations

from rltserve.models.base import LoopedModel, LoopedSpec

# The zero-shot criteria whose value after each loop needs that loop's next-token distribution
# (README, Models): ``latent-diff`` compares states and the gate is part of the loop.
HEAD_PER_LOOP = ("kl", "minp-kl", "entropy-diff", "argmax-stability")


def flops_per_token(model: LoopedModel) -> tuple[float, float]:
    """(F0, Fr): matmul FLOPs of one token outside the loop (prelude + coda + head) and of one
    loop, counted as 2 x the parameters each touches (attention scores are left out)."""
    names = dict(model.named_parameters())
    loop_keys = ("layers.", "core_block.", "adapter", "model.norm", "early_exit_gate")
    per_loop = sum(p.numel() for n, p in names.items() if any(k in n for k in loop_keys))
    total = sum(p.numel() for p in names.values())
    spec: LoopedSpec = model.spec
    # An untied embedding is a lookup (no FLOPs); a tied one is also the head and counts once.
    tied = not any("lm_head" in n for n in names)
    embed = 0 if tied else spec.vocab_size * spec.hidden_size
    return 2.0 * (total - per_loop - embed), 2.0 * per_loop


def flop_bound(f0: float, fr: float, loops: int, mean_exit: float, prompt: int, out: int) -> dict:
    """Speed-up bounds of early exit: decode-only (DESIGN §10) and for the whole workload, where
    prompt tokens always run every loop. ``loops``: the run's full depth (its ``max_loops``, not
    the model's default when they differ)."""
    decode = (f0 + loops * fr) / (f0 + mean_exit * fr)
    full = prompt * loops * fr + out * (f0 + loops * fr)
    adaptive = prompt * loops * fr + out * (f0 + mean_exit * fr)
    return {"flop_bound_decode": decode, "flop_bound_workload": full / adaptive}


def exit_criterion_run(criterion: str | None, threshold: float, has_gate: bool) -> str | None:
    """The zero-shot criterion a request runs (None: the gate, or a fixed depth): its own, or
    ``kl`` where it names none and asks an adaptive exit of a model without a gate."""
    if has_gate:
        return None
    if criterion is None and threshold < 1.0:
        return "kl"
    return criterion


def run_flop_bound(
    f0: float,
    fr: float,
    loops: int,
    mean_exit: float,
    prompt: int,
    out: int,
    kv_policy: str,
    criterion: str | None,
) -> dict:
    """``flop_bound``'s keys for the run: its formula where early exit saves the loops it
    skips; else 1.0 (``kv_policy`` full: every loop runs) or None (``criterion`` in
    ``HEAD_PER_LOOP``: the formula leaves out the coda and head of every loop), with
    ``flop_bound_note`` saying why."""
    if criterion in HEAD_PER_LOOP:
        return {
            "flop_bound_decode": None,
            "flop_bound_workload": None,
            "flop_bound_note": f"exit_criterion {criterion} runs the coda and the head at every "
            "loop, which the bound (F0 once per token) does not count",
        }
    if kv_policy == "full":
        return {
            "flop_bound_decode": 1.0,
            "flop_bound_workload": 1.0,
            "flop_bound_note": "kv_policy full: every token runs every loop (only its output "
            "comes from its exit), so early exit saves no compute",
        }
    return flop_bound(f0, fr, loops, mean_exit, prompt, out)
