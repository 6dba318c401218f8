"""How a request's seed seeds torch's generators: the sampler's and Huginn's initial state's.

torch reads a seed modulo 2**64 (``manual_seed(-1)`` is ``manual_seed(2**64 - 1)``). CUDA's
Philox generator takes all 64 bits, but the CPU's mt19937 only the low 32 (``init_genrand``):
there seeds 5 and 5 + 2**32 would draw the same stream. A CPU generator here is
``manual_seed(low)``, the stream every seed in [0, 2**32) has always had, and for a seed with
high bits its state words from the third on are XORed with those of ``manual_seed(high)``. Word
1 of ``manual_seed(x)`` is a bijection of x (``1812433253 * (x ^ x >> 30) + 1``), and word 2 of
the mask one of ``high``, so distinct ``(low, high)`` give distinct states (and a nonzero mask is
never all zero), hence distinct streams: mt19937's update and tempering are bijections.
"""

from __future__ import annotations

import numpy as np
import torch

SEED_MODULUS = 2**64  # torch reads seeds modulo 2**64
LOW_BITS = 32  # what the CPU's mt19937 takes from a seed
# The 624 mt19937 state words in torch's CPU generator state (``CPUGeneratorImplStateLegacy``:
# the seed, ``left`` and ``seeded`` (int32 each) and ``next`` come first), one uint64 each.
_STATE_WORDS = slice(24, 24 + 624 * 8)


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` whose stream is ``seed``'s: distinct seeds modulo 2**64 draw
    distinct streams, and a seed in [0, 2**32) (anywhere) or any seed off the CPU draws the
    stream ``manual_seed(seed)`` gives."""
    if torch.device(device).type != "cpu":
        return torch.Generator(device=device).manual_seed(seed)
    seed %= SEED_MODULUS
    return cpu_generator(seed, seed >> LOW_BITS)


def cpu_generator(low: int, high: int) -> torch.Generator:
    """A CPU generator: ``manual_seed(low)`` (whose mt19937 reads ``low``'s low 32 bits) with
    ``high`` (in [0, 2**32)) mixed into its state where it is not 0."""
    gen = torch.Generator().manual_seed(low)
    if high:
        state = gen.get_state()
        mask = torch.Generator().manual_seed(high).get_state()
        words = state.numpy()[_STATE_WORDS].view(np.uint64)  # (views: XORed in place)
        words[2:] ^= mask.numpy()[_STATE_WORDS].view(np.uint64)[2:]
        gen.set_state(state)
    return gen
