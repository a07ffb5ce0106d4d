"""The README's tour runs as written."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_tour_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    namespace = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    np.testing.assert_array_equal(namespace["cache"].lengths, [17, 13, 0, 0])
    assert "[17 13  0  0]" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
    """README's two set-up commands: the second (the tests) is what .ci/run runs."""
    commands = re.findall(r"^    (python3 -m pip install .*)$", README.read_text(), re.M)
    assert len(commands) == 2, commands
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
