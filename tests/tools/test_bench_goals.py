"""``graphlane bench`` says what it is doing and whether its goals were met (issue 16, 9)."""

from __future__ import annotations

from graphlane.tools.bench_goals import format_goals, goals, progress


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
