"""A launched script's output as text (launch/output.py): one rank mark, `\r` updates settled for a
file, and the last traceback a rank printed, found without torch's `@record`."""

from __future__ import annotations

from raytrain_ddp.launch.output import ended_on_traceback, last_traceback, mark, settled, unmark

# What torch's excepthook prints once a process group exists: every line marked, blank lines bare.
RAISED = """\
epoch 0
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/train.py", line 56, in <module>
[rank1]:     check_step(step)
[rank1]:   File "/tmp/train.py", line 32, in check_step
[rank1]:     raise RuntimeError(f"rank {rank} failed")
[rank1]: RuntimeError: rank 1 failed at step 5
[rank1]:[W1126 06:01:02 ProcessGroupGloo.cpp:1] a warning at exit
"""


def test_one_rank_mark_where_torch_put_its_own():
    assert unmark("[rank1]: RuntimeError: x") == "RuntimeError: x" and unmark("[rank12]:[W1 c10d] w") == "[W1 c10d] w"
    assert unmark("rank 1: [rank1]: kept") == "rank 1: [rank1]: kept"  # only a mark at the start
    assert mark(1, "[rank1]: RuntimeError: x") == "[rank1]: RuntimeError: x"
    assert mark(0, "[rank0]:[W1123 c10d] warning") == "[rank0]: [W1123 c10d] warning"
    assert mark(0, "") == "[rank0]: "


def test_each_update_is_marked_on_a_terminal_and_settled_for_a_file():
    assert mark(0, " 10%\r100%") == "[rank0]:  10%\r[rank0]: 100%"
    assert mark(0, "\rstep 0\rstep 1") == "\r[rank0]: step 0\r[rank0]: step 1"  # no mark on the empty start
    assert settled("\rstep 0\rstep 1") == "step 1" and settled("step 1\r   ") == "step 1" and settled("") == ""
    assert "\r" not in mark(0, settled("\rstep 0\rstep 1"))


def test_the_last_traceback_is_the_root_cause_without_its_rank_marks():
    error = last_traceback(RAISED.splitlines())
    assert error.message == "RuntimeError: rank 1 failed at step 5"
    assert error.traceback.splitlines()[0] == "Traceback (most recent call last):"
    assert error.traceback.splitlines()[-1] == "RuntimeError: rank 1 failed at step 5"  # not the warning after it
    assert "[rank1]" not in error.traceback and '  File "/tmp/train.py", line 32, in check_step' in error.traceback
    assert last_traceback(["epoch 0", "done"]) is None


def test_a_script_that_raised_is_told_from_one_that_printed_a_traceback_and_went_on():
    aborted = [*RAISED.splitlines(), "", "terminate called without an active exception"]
    assert ended_on_traceback(RAISED.splitlines()) and ended_on_traceback(aborted)
    assert last_traceback(aborted).traceback.splitlines()[-1] == "RuntimeError: rank 1 failed at step 5"
    right_after = ["Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "KeyError: 'k'",
                   "terminate called without an active exception"]  # no blank line before libstdc++'s
    assert ended_on_traceback(right_after) and last_traceback(right_after).traceback.endswith("KeyError: 'k'")
    went_on = [*RAISED.splitlines(), "retrying from the last checkpoint", "terminate called without an active exception"]
    assert not ended_on_traceback(went_on)
    assert not ended_on_traceback(["epoch 0", "terminate called without an active exception"])


def test_a_chained_exception_keeps_its_chain_and_an_earlier_unrelated_one_is_left_out():
    lines = [
        "Traceback (most recent call last):", '  File "a.py", line 1, in <module>', "KeyError: 'old'",
        "a warning between",
        "Traceback (most recent call last):", '  File "a.py", line 3, in <module>', "ValueError: first",
        "", "During handling of the above exception, another exception occurred:", "",
        "Traceback (most recent call last):", '  File "a.py", line 5, in <module>', "OSError: second",
        "  with a second line of message",
    ]
    error = last_traceback(lines)
    assert error.message == "OSError: second"
    assert error.traceback == "\n".join(lines[4:])
