"""Where the user's code comes from on the workers, and what is never shipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_ddp.config import ConfigError
from raytrain_ddp.driver.plan.shipping import Placement


@pytest.mark.parametrize("directory", [Path.home(), Path("/")])
def test_home_or_root_is_never_shipped(directory):
    with pytest.raises(ConfigError, match="move the script .* into a project directory of its own"):
        Placement(directory, nodes=2, lacking=1).runtime_env()
    assert Placement(directory, nodes=2, lacking=0).runtime_env() == {}  # shared: nothing to ship


def test_a_project_directory_is_shipped(tmp_path):
    env = Placement(tmp_path, nodes=2, lacking=1).runtime_env()
    assert env["working_dir"] == str(tmp_path) and ".git" in env["excludes"]
