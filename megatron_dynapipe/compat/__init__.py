"""Below everything that touches megatron-core's, Megatron-LM's or torch's internals: the one
patching mechanism (:mod:`.patching`: spots checked against the installed source, rebinds undone
last first, :class:`~.patching.UpstreamChanged`) and running megatron-core on the CPU
(:mod:`.cpu_compat`). It imports nothing else of this package, so that both ``megatron/``
(training) and ``tracer/`` (fake ranks) build on it without importing each other.
"""
