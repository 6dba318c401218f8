"""Benchmarks: ``offline`` (``rltserve bench offline``: the engine in process, with its
``--compare`` runs), ``prefill`` (wavefront vs chunked prefill time to first token), ``kv`` (KV
pressure: whole-context reservation vs on-demand blocks) and ``serve`` (``rltserve bench
serve``: a client against a running server); ``commands`` runs the offline, rollout and host
benchmarks for the command line.

Nothing is imported here: ``serve`` must not pull in torch, the others do.
"""
