"""Scale-out on Ray (the optional ``ray`` extra): ``rltserve serve --replicas N`` serves N engine
replicas as a Ray Serve deployment (``rltserve.ray.client``), and ``generate`` splits an offline
batch over N replicas (``rltserve.ray.offline``). Importing this package does not import Ray.
"""

from __future__ import annotations

from typing import Any


def generate(prompts=None, params=None, *, replicas: int, **kwargs: Any) -> list:
    """Offline generation over ``replicas`` Ray actors; see ``rltserve.ray.offline.generate``."""
    from rltserve.ray.offline import generate as _generate

    return _generate(prompts, params, replicas=replicas, **kwargs)


__all__ = ["generate"]
