"""Planner benchmark (same as `megatron-dynapipe bench planner`); run from the project root."""

import argparse
import sys

from megatron_dynapipe.bench import planner_bench as planner

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=planner.__doc__)
    planner.add_arguments(parser)
    sys.exit(planner.run(parser.parse_args()))
