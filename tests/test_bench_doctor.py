"""`raytrain bench doctor`, tiny: the three variants train on real gloo ranks and the figures print."""

from __future__ import annotations

from conftest import raytrain


def test_the_doctor_benchmark_prints_each_variant_against_plain_and_the_marks_cost():
    proc = raytrain("bench", "doctor", "--model", "convnet", "--image-size", "8", "--batch", "4", "--steps", "2",
                    "--rounds", "1", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| plain", "| timed", "| plain again"], proc.stdout
    assert "the marks alone: " in proc.stdout and "once per epoch" in proc.stdout, proc.stdout


def test_a_model_the_benchmark_does_not_know_is_one_line():
    proc = raytrain("bench", "doctor", "--model", "nope")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: unknown --model 'nope'; choose from convnet, resnet18, resnet50"
