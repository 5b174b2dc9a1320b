"""The README's Python example is examples/python/quickstart.py, verbatim, and runs as written.
(The C++ example, examples/consumer/main.cpp, is checked the same way by CTest's
Docs.ReadmeExamplesMatchFiles and built against the installed package by scripts/check_install.sh.)"""
import os
import re
import subprocess
import sys

from conftest import ROOT


def readme_blocks():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return re.findall(r"<!-- example: (\S+) -->\n```[a-z+]*\n(.*?\n)```\n", text, flags=re.S)


def test_readme_examples_are_the_files():
    blocks = dict(readme_blocks())
    assert "examples/python/quickstart.py" in blocks and "examples/consumer/main.cpp" in blocks
    for path, block in blocks.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            assert block == f.read(), f"README.md's block for {path} differs from the file"


def test_python_example_runs(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "quickstart.py")],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["(2, 4, 8, 16) float32", "(2, 6, 2)", "True (2, 5, 5)"]
