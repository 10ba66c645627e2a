"""megatron-dynapipe: dynamic micro-batching and pipeline schedules for Megatron-LM."""

__version__ = "0.1.0"
