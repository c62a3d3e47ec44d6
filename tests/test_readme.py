"""Every Python example in the README runs as written and prints what its comments say."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def _expected_lines(block: str) -> list[str]:
    """The `# expected` comment after each print(...) call, where there is one."""
    return [
        match.group(1).strip()
        for match in re.finditer(r"^print\(.*\)\s+# (.+)$", block, re.MULTILINE)
    ]


def test_readme_has_examples() -> None:
    assert len(_python_blocks()) >= 2


def test_readme_examples_print_what_they_say() -> None:
    for block in _python_blocks():
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
        printed = output.getvalue()
        for expected in _expected_lines(block):
            shown = expected.split(":")[0].strip()  # text after ':' is commentary
            assert shown in printed, f"README promises {shown!r}, the code printed:\n{printed}"


def test_docstring_examples_run() -> None:
    import doctest

    from kvdefrag.server import _engine

    failures, attempted = doctest.testmod(_engine, raise_on_error=False)
    assert attempted > 0 and failures == 0
