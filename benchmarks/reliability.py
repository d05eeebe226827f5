"""Figures for the README's reliability table (measured in graphlane.bench.reliability):
a worker SIGKILLed under load, overload against a bounded queue, hostile frames.

    .venv/bin/python benchmarks/reliability.py
"""

from __future__ import annotations

from graphlane.bench.reliability import main

if __name__ == "__main__":
    main()
