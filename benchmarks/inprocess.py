"""graphlane beside the field's in-process loop, same program, same timed sim, one run
(see graphlane/bench/inprocess.py): lone-step latency and windowed steps/s,
daemon over in-process, measured in alternation.

.venv/bin/python benchmarks/inprocess.py [--steps 60] [--reps 3] [--profile field] [--json]
"""

from graphlane.bench import inprocess
from graphlane.bench.script import run_profiles

if __name__ == "__main__":
    run_profiles(inprocess, __doc__)
