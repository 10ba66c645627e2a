"""Executor benchmark (same as `megatron-dynapipe bench executor`): DynaPipe's plan executor vs
megatron-core's 1F1B on identical fixed-shape micro-batches (CPU, tiny GPT)."""

import argparse
import sys

from megatron_dynapipe.bench import executor_bench as executor

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=executor.__doc__)
    executor.add_arguments(parser)
    sys.exit(executor.run(parser.parse_args()))
