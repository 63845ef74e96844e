#!/usr/bin/env python3
"""The main job: serve a multi-turn chat workload (or a Mooncake trace) through a
FastDeploy-style engine with fastkv, and again with every prompt recomputed, then
check that the outputs are identical. See `python tools/demo.py --help`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `tools` and `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.engine.demo import main

if __name__ == "__main__":
    sys.exit(main())
