"""Step benchmark (same as `megatron-dynapipe bench step`): real megatron-core steps of one global
batch as DynaPipe (padded and varlen), pad-to-max, packing and THD packing (whole) plans; real
tokens/s and predicted vs measured time."""

import argparse
import sys

from megatron_dynapipe.bench import step_bench as step

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=step.__doc__)
    step.add_arguments(parser)
    sys.exit(step.run(parser.parse_args()))
