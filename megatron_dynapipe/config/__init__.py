"""The shared concepts every feature speaks, at the bottom of the package; nothing here imports
torch, megatron or another part of the package.

* :mod:`.model`: :class:`~.model.ModelSpec`, the one GPT description, and the named sizes;
* :mod:`.model_flags`: a model as Megatron-LM's flags, both ways;
* :mod:`.layout`: Megatron's parallel layout (checks, rank <-> coordinates, process groups);
* :mod:`.megatron_options`: Megatron-LM's training options that change which ops a rank issues
  (distributed optimizer, overlap, recompute, sequence parallelism, interleaving);
* :mod:`.accounting`: parameters, FLOPs and activation bytes, counted once.
"""
