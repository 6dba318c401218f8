"""The OpenAI-compatible HTTP server (``rltserve serve``).

Modules, outside in: ``cli`` (flags and commands), ``server`` (sockets, signals, uvloop),
``app`` (the app factory and engine lifecycle), ``middleware`` (errors, auth), ``handlers``
(routes) and ``admin`` (weight updates), ``plans`` (request -> choices), ``delivery``
(admission, stream or body), ``frontend`` (prompt checks and the per-request bridge to the
stage), ``supervisor`` (stage restarts), ``encoding`` (tokenizer work off the event loop),
``responses`` and ``sse`` (wire shapes), ``body``, ``schemas`` and ``validation`` (request
bodies), ``session`` (the replica affinity key), ``admission``, ``metrics``
(prometheus-client), ``state``, ``config``, ``errors``.
The serving benchmark client is ``rltserve.bench.serve``.

Nothing is imported here, so ``rltserve.http.cli`` stays cheap to import.
"""
