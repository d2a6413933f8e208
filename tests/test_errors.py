"""errors.py: a failure's one line, with the fix where the cause is known."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raytrain_ddp.errors import one_line


def test_a_label_outside_num_classes_names_the_flag():
    """A dataset of the user's own is not scanned before training: its first bad label fails the
    loss on a rank, and the line must say which setting to fix, not only torch's words."""
    with pytest.raises(IndexError) as err:
        F.cross_entropy(torch.zeros(2, 4), torch.tensor([1, 5]))
    assert one_line(err.value) == (
        "a sample's label is not below --num-classes (torch: Target 5 is out of bounds); "
        "pass --num-classes above the largest label, or fix the labels")
    assert one_line(ValueError("Target practice is out of bounds")) == "Target practice is out of bounds"
