"""Decoding ahead through a daemon beside the field's in-process decode loop, on the
model program, same timed sim, one run (see graphlane/bench/decode.py): tokens/s
decoding ahead vs the modelled limit, vs the in-process loop and vs the same daemon
when the scheduler waits for each step's tokens; a lone step's latency, daemon over
in-process. Measured in alternation.

.venv/bin/python benchmarks/decode.py [--steps 60] [--reps 3] [--profile field] [--json]
"""

from graphlane.bench import decode
from graphlane.bench.script import run_profiles

if __name__ == "__main__":
    run_profiles(decode, __doc__)
