"""`cadence demo` drives the installed scheduler (no bench/ file needed)."""

from cadence.cli import main


def test_demo_times_the_real_scheduler(capsys):
    assert main(["demo", "--num-requests", "4", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 requests,") and "12 tokens" in out and "us/step" in out
