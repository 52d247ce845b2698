"""Guide pages whose Python blocks build on each other run in order, as one session, and print
what their comments say (``print(x)  # what it prints``): optimizers.md, checkpoints.md, zero.md.
(tests/test_readme.py leaves the pages named here to this module.)"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guides"


@pytest.mark.parametrize(
    ("page", "least_blocks"), [("optimizers.md", 6), ("checkpoints.md", 9), ("zero.md", 3)]
)
def test_the_guide_runs_and_prints_what_it_says(page: str, least_blocks: int) -> None:
    guide = GUIDES / page
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= least_blocks
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"{guide.name} block {i}", "exec"), namespace)
        said = re.findall(r"^print\(.*\)\s+# (.*)$", block, flags=re.M)
        assert out.getvalue().splitlines() == said, f"block {i}"
