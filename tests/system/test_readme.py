"""Every Python example in the README runs as written and prints what its comments say."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def _expected_lines(block: str) -> list[str | None]:
    """Per print() call, in order: the output its `# comment` promises, or None.

    A comment is the exact line printed, optionally followed by " (commentary)".
    """
    expected: list[str | None] = []
    for line in block.splitlines():
        match = re.match(r"^\s*print\(.*\)(?:\s+# (.+))?$", line)
        if match:
            comment = match.group(1)
            expected.append(None if comment is None else comment.split(" (")[0].strip())
    return expected


def test_readme_has_examples() -> None:
    assert len(_python_blocks()) >= 2


def test_readme_examples_print_what_they_say() -> None:
    for block in _python_blocks():
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
        printed = output.getvalue().splitlines()
        expected = _expected_lines(block)
        assert len(printed) == len(expected), f"one line per print(), got:\n{printed}"
        promised = [(want, got) for want, got in zip(expected, printed, strict=True) if want]
        assert promised, "the example promises no output"
        for want, got in promised:
            assert got == want, f"README promises {want!r}, the code printed {got!r}"
