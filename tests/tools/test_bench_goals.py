"""``graphlane bench`` says what it is doing and whether its goals were met (issue 16, 9)."""

from __future__ import annotations

from graphlane.bench.goals import format_goals, goals, progress


def _report(rtt: float, windowed: float, bandwidth: float, spread: float) -> dict:
    null = {"step_rtt_vs_raw": rtt, "windowed_vs_raw": windowed, "windowed_spread": spread}
    return {"control_plane": {"null": null}, "bandwidth": {"null": {"bandwidth_vs_raw": bandwidth}}}


def test_goals_pass_fail_and_noise() -> None:
    quiet = goals(_report(1.1, 0.95, 1.1, 0.05))
    assert [g["met"] for g in quiet] == [True, True, True] and not any(g["noisy"] for g in quiet)
    text = "\n".join(format_goals(_report(1.7, 0.6, 1.0, 0.4)))
    assert "step round trip vs raw" in text and "1.70x, goal <= 1.15x: FAIL" in text
    assert "0.60x, goal >= 0.9x: FAIL (noisy)" in text and "too noisy" in text
    assert "1.00x, goal >= 1.0x: PASS" in text


def test_progress_lines_go_to_stderr(capsys) -> None:
    with progress("something slow"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and "measuring something slow" in err and "done in" in err


def test_the_zero_cost_rate_is_a_goal_in_steps_per_second() -> None:
    report = {"zero_cost": {"steps_s": 1712.4}}
    (goal,) = goals(report)
    assert goal["goal"] == "zero-cost steps/s" and not goal["met"]
    assert "1712, goal >= 2000: FAIL" in "\n".join(format_goals(report))
    assert goals({"zero_cost": {"steps_s": 2050.0}})[0]["met"]


def test_each_pipeline_profile_has_its_goals_and_serial_counts_where_balanced() -> None:
    """Issue 20: through a daemon, >= 0.95 of the limit and latency <= 1.1x the floor
    for every profile, >= 1.8x the serial mode for the balanced ones."""
    report = {"pipeline": [
        {"profile": "update-bound", "pipelined_vs_limit": 0.99, "pipelined_vs_serial": 1.41,
         "latency_vs_floor": 1.21},
        {"profile": "balanced", "pipelined_vs_limit": 0.93, "pipelined_vs_serial": 2.1,
         "latency_vs_floor": 1.08},
    ]}  # fmt: skip
    by_name = {g["goal"]: g for g in goals(report)}
    assert set(by_name) == {
        "update-bound vs limit", "update-bound latency vs floor",
        "balanced vs limit", "balanced vs serial", "balanced latency vs floor",
    }  # fmt: skip
    assert by_name["update-bound vs limit"]["met"] and not by_name["balanced vs limit"]["met"]
    assert by_name["balanced vs serial"]["met"]
    assert not by_name["update-bound latency vs floor"]["met"]
    assert by_name["balanced latency vs floor"]["met"]
    text = "\n".join(format_goals(report))
    assert "update-bound latency vs floor 1.21x, goal <= 1.1x: FAIL" in text
    assert "balanced vs serial" in text and "2.10x, goal >= 1.8x: PASS" in text


def test_a_near_miss_is_not_printed_as_its_goal() -> None:
    report = {"paged": {"pipeline": {"pipelined_vs_limit": 0.9497}}}
    assert "paged decode vs limit" in (text := "\n".join(format_goals(report)))
    assert "0.9497x, goal >= 0.95x: FAIL" in text
