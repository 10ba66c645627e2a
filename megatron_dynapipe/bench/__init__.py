"""Benchmarks runnable from the CLI (`megatron-dynapipe bench ...`) and from benchmarks/."""
