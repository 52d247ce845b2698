"""docs/guides/checkpoints.md runs: its Python blocks, in order, print what their comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "checkpoints.md"


def test_the_checkpoints_guide_runs_and_prints_what_it_says() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 9
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"{GUIDE.name} block {i}", "exec"), namespace)
        said = re.findall(r"^print\(.*\)\s+# (.*)$", block, flags=re.M)
        assert out.getvalue().splitlines() == said, f"block {i}"
