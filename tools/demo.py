#!/usr/bin/env python3
"""The main job: serve a multi-turn chat workload (or a Mooncake trace) through a
FastDeploy-style engine with fastkv, and again with every prompt recomputed, then
check that the outputs are identical. See `python tools/demo.py --help`."""

import sys

from fastkv.engine.demo import main

if __name__ == "__main__":
    sys.exit(main())
