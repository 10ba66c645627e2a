"""Below everything that touches megatron-core's or torch's internals: running megatron-core on
the CPU (:mod:`.cpu_compat`). It imports nothing else of this package, so that both
``megatron/`` (training) and ``tracer/`` (fake ranks) build on it without importing each other.
"""
