"""Tools that drive a daemon or the simulated NPU from outside: the load test and its
report, the benchmarks, the demo and the sim example. Nothing here runs inside the
daemon or a worker."""
