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
