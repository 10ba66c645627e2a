"""Below everything that touches megatron-core's, Megatron-LM's or torch's internals, and the one
place where the supported upstream versions differ:

* :mod:`.patching` -- the one patching mechanism: spots checked against the installed source
  (a :class:`~.patching.OneOf` where versions differ), rebinds undone last first,
  :class:`~.patching.UpstreamChanged`;
* :mod:`.upstream` -- the supported megatron-core range and the megatron-core calls whose form
  differs between versions;
* :mod:`.megatron_lm_script` -- where Megatron-LM's ``pretrain_gpt.py`` differs between tags;
* :mod:`.cpu_compat`, :mod:`.megatron_lm_cpu`, :mod:`.moe_cpu` -- megatron-core, Megatron-LM's
  training loop and MoE layers on the CPU.

It imports nothing else of this package, so that both ``megatron_lm/`` and ``runtime/`` (training)
and ``tracer/`` (fake ranks) build on it without importing each other. docs/compatibility.md lists
every version difference and where it is handled.
"""
