"""The README's example runs as shown."""

import pathlib
import re
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def test_numpy_two_processes_example_runs():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "numpy_two_processes.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "moved 64 arrays of 1 MiB to another process and back, no copy" in proc.stdout


def test_readme_shows_the_example_as_it_is():
    """The README's Python block is the example file, word for word."""
    readme = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    example = (EXAMPLES / "numpy_two_processes.py").read_text()
    assert example in blocks
