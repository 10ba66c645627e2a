"""The planning core: pure Python and numpy, imports neither torch nor Megatron."""
