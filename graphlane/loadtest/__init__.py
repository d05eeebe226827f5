"""``graphlane loadtest``: drive a program of a running daemon as its ``hello`` entry
describes it, and measure it. One load tester, one config (:class:`.config.LoadConfig`),
one report.

The program's hello entry picks the shape of load (:mod:`.workload`): a program without
device state gets **independent calls** (:mod:`.calls`: closed loop of C callers, or
open loop of Poisson arrivals at R calls/s, latency from the scheduled arrival); a
program with device state (e.g. a paged KV cache) gets a scheduler's **continuous
batching** loop (:mod:`.batching`: C live sequences or R sequence arrivals/s, their
state written with the program's state operations, one step in flight per device).
A model program (a state op ``prefill``) gets requests served by a continuous-batching
generation loop that decodes ahead (:mod:`.generation`, the demo's loop), measured as
vLLM's ``benchmark_serving`` measures a server: request and token throughput, TTFT,
TPOT, ITL (:mod:`.serving`).
What a call carries and how its answer is checked is the program's workload
(:mod:`.attention`, :mod:`.paged`), picked by :mod:`.driver`, whose
:func:`~.driver.run_load` runs it all.

Both shapes stop starting steps after ``--duration`` and wait at most ``--timeout`` more
for the calls in flight (each call also has that deadline); a call still unanswered then
is cancelled and counted as ``CLIENT_DEADLINE``. A stop (from the command line, a
first Ctrl-C) ends the run within a second: arrivals end at once, the calls in flight
get at most :data:`.run.STOP_DRAIN_S` before they are cancelled, and a model's tokens
are not checked (the report is still written, marked ``interrupted``, with the real
``sending_s``; the command then exits 130); a second one aborts (one line, 130), as
does a Ctrl-C before the run started. Every error is counted by its wire code (a
:class:`~graphlane.GraphlaneError`'s ``code``; any other exception by its class name)
and the device that gave it is held back (exponential backoff with jitter, capped; see
:mod:`.availability`), so that a server that fails at once is not hammered.

A ``--verify`` share of the steps is checked against a reference computed in this
process, written independently of the device's kernel (torch's
``scaled_dot_product_attention``); a mismatch is counted (``verify_failures``) and the
run goes on.

The report (:func:`~.driver.run_load` returns it, :mod:`.report` builds it and
:mod:`.report_files` writes it as ``report.json`` and ``report.html`` with PNG plots):
``load`` ("calls" or "sequences"), successful ``steps``, ``throughput`` (steps/s over the
whole run, tail included), ``latency_ms`` (min, mean, p50, p90, p99, p99.9, max from an
HDR histogram of microseconds with 3 significant digits; its encoding is
``latency_hdr_us``), ``errors`` by code, ``verified`` / ``verify_failures``,
``per_device`` and ``per_batch`` counts and percentiles, a ``timeseries`` (~120
windows), the open loop's ``send_lag_ms`` (independent calls: how late the client sent,
already part of the latency), the resolved ``config`` and a ``verdict``; a run of
sequences adds its own figures (tokens/s, occupancy, sequences, request bytes: see
:mod:`.batching`).

Exit status of :func:`.cli.main`: 0 when at least one step succeeded, no checked output
was wrong and every error was retryable (BUSY, TIMEOUT, WORKER_LOST, SHUTTING_DOWN, or
the client's own CLIENT_OVERLOAD / CLIENT_DEADLINE: what a loaded or restarting server
is expected to answer); 1 when a check failed, an error was not retryable (BAD_REQUEST,
INTERNAL, a client exception...), no step succeeded, or the server was unavailable for
more than ``max_unavailable`` of the sending time (see :mod:`.availability`); 2 when
the flags are invalid or the run could not start (program not served or not one the
load test can drive, shapes differ); 3 when nothing answered at the endpoint within
``--connect-timeout``; 130 after a Ctrl-C, wherever it came.
"""

from typing import TYPE_CHECKING, Any

from .config import LoadConfig

if TYPE_CHECKING:
    from .driver import run_load
    from .workload import LoadTestError


def __getattr__(name: str) -> Any:
    """run_load and LoadTestError (the run: the client and torch), imported when asked
    for: graphlane's command line reads the load test's flags for every command."""
    if name == "run_load":
        from .driver import run_load

        return run_load
    if name == "LoadTestError":
        from .workload import LoadTestError

        return LoadTestError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LoadConfig", "LoadTestError", "run_load"]
