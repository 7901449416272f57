"""The README's block example runs and asserts what it claims."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_block_usage_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "mhc.MHCBlock(" in b)
    exec(compile(example, "README.md", "exec"), {})
