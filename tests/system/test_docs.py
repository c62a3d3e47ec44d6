"""The README and the docs site hold only what is true: examples run, names and links resolve.

Every fenced block of README.md and docs/ is one of three kinds, and nothing else passes:

* ``python``: run here as written; a ``print(...)  # text`` line must print ``text``.
* ``text``: a diagram or a sample of output, not code.
* any other language (``bash``, ...): not run, and says why in a ``<!-- not run: reason -->``
  comment on the line above it. What such a block names is still checked where it can be:
  the vLLM classes it selects exist, and the grpcurl block is what ``make run`` prints.

Links are checked by ``make docs`` (``mkdocs build --strict``), whose checks a test here
shows failing on a broken anchor, a missing page and a page left out of the nav; the
README, outside the site, and the code's citations of pages are checked here.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdefrag.server.__main__ import poke_commands

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_NOT_RUN = re.compile(r"^\s*<!-- not run: (\S.*\S) -->\s*$")
_PRINT = re.compile(r"^\s*print\(.*\)(?:\s+# (.+))?$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, its code, its not-run reason."""

    path: Path
    line: int
    language: str
    code: str
    not_run_reason: str | None

    def __str__(self) -> str:
        name = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{name}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every page under docs/, sorted."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file (indented ones in lists included)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    start: tuple[int, str, str] | None = None  # (line index, indent, language)
    for index, line in enumerate(lines):
        match = _FENCE.match(line)
        if not match:
            continue
        if start is None:
            start = (index, match.group(1), match.group(2))
            continue
        first, indent, language = start
        code = "\n".join(body.removeprefix(indent) for body in lines[first + 1 : index]) + "\n"
        above = next((text for text in reversed(lines[:first]) if text.strip()), "")
        reason = _NOT_RUN.match(above)
        found.append(Block(path, first + 1, language, code, reason and reason.group(1)))
        start = None
    assert start is None, f"{path.relative_to(ROOT)}:{start[0] + 1}: a fence is never closed"
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks_of(path)]


def python_blocks() -> list[Block]:
    return [block for block in all_blocks() if block.language == "python"]


def expected_lines(code: str) -> list[str | None]:
    """Per print() call, in order: the output its `# comment` promises, or None.

    A comment is the exact line printed, optionally followed by " (commentary)".
    """
    expected: list[str | None] = []
    for line in code.splitlines():
        match = _PRINT.match(line)
        if match:
            comment = match.group(1)
            expected.append(None if comment is None else comment.split(" (")[0].strip())
    return expected


def check_kinds(blocks: list[Block]) -> list[str]:
    """What is wrong with each block's kind: the rules of this module's docstring."""
    problems = []
    for block in blocks:
        if block.language == "python" and block.not_run_reason:
            problems.append(f"{block}: a python block always runs; drop the not-run comment")
        elif block.language not in ("python", "text") and not block.not_run_reason:
            kind = block.language or "a block without a language"
            problems.append(f"{block}: {kind} is not run, so say why: <!-- not run: ... -->")
    return problems


def test_every_block_runs_or_says_why_not() -> None:
    assert check_kinds(all_blocks()) == []


def test_a_block_that_neither_runs_nor_says_why_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nmake demo\n```\n\n```\ndiagram\n```\n\n"
        "<!-- not run: ok -->\n```bash\nmake test\n```\n\n"
        "<!-- not run: no -->\n```python\nx = 1\n```\n"
    )
    problems = [problem.split(": ", 1)[1] for problem in check_kinds(blocks_of(page))]
    assert problems == [
        "bash is not run, so say why: <!-- not run: ... -->",
        "a block without a language is not run, so say why: <!-- not run: ... -->",
        "a python block always runs; drop the not-run comment",
    ]


def test_the_docs_have_examples() -> None:
    in_readme = [block for block in python_blocks() if block.path == README]
    assert len(in_readme) >= 1
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("block", python_blocks(), ids=str)
def test_python_examples_print_what_they_say(block: Block) -> None:
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block.code, str(block), "exec"), {"__name__": "docs_example"})
    printed = output.getvalue().splitlines()
    expected = expected_lines(block.code)
    assert len(printed) == len(expected), f"{block}: one line per print(), got:\n{printed}"
    promised = [(want, got) for want, got in zip(expected, printed, strict=True) if want]
    assert promised, f"{block}: the example promises no output"
    for want, got in promised:
        assert got == want, f"{block} promises {want!r}, the code printed {got!r}"


def test_a_wrong_promise_is_caught() -> None:
    block = Block(README, 1, "python", "print(1 + 1)  # 3\n", None)
    with pytest.raises(AssertionError, match="promises '3', the code printed '2'"):
        test_python_examples_print_what_they_say(block)


def defined_names(module: Path) -> set[str]:
    """Names a module defines at top level, lists in ``__all__`` or builds in ``__getattr__``."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        if isinstance(node, ast.Assign):
            targets = {target.id for target in node.targets if isinstance(target, ast.Name)}
            names.update(targets)
            if "__all__" in targets and isinstance(node.value, ast.List):
                names.update(
                    item.value for item in node.value.elts if isinstance(item, ast.Constant)
                )
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            names.update(
                const.value
                for const in ast.walk(node)
                if isinstance(const, ast.Constant) and isinstance(const.value, str)
            )
    return names


def test_every_vllm_class_the_docs_name_exists() -> None:
    """vLLM is not imported here: the module's source says what it defines."""
    package = ROOT / "integrations" / "vllm" / "src"
    named: set[str] = set()
    for path in doc_files():
        named.update(re.findall(r"\bkvdefrag\.vllm\.[a-z_.]+\.[A-Z]\w+", path.read_text()))
    assert "kvdefrag.vllm.worker.DefragWorker" in named
    missing = []
    for dotted in sorted(named):
        module_name, _, name = dotted.rpartition(".")
        module = package / (module_name.replace(".", "/") + ".py")
        if not module.is_file() or name not in defined_names(module):
            missing.append(dotted)
    assert missing == [], f"the docs name classes that do not exist: {missing}"


def test_the_grpcurl_block_is_what_make_run_prints() -> None:
    """tests/system/test_make_run.py runs what ``make run`` prints; the page shows the same."""
    (block, *_) = blocks_of(DOCS / "operator" / "grpcurl.md")
    printed = poke_commands("127.0.0.1:50051", 9464).splitlines()
    assert printed[0] == "try:"
    assert block.code.splitlines() == [line.strip() for line in printed[1:]]


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors_of(page: Path) -> set[str]:
    text = page.read_text()
    anchors = {slug(heading) for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}
    return anchors | set(re.findall(r'<a id="([\w-]+)"></a>', text))


def broken_targets(citations: list[tuple[str, str]]) -> list[str]:
    """The (where, "docs/page.md#anchor") citations whose page or anchor does not exist."""
    broken = []
    for where, target in citations:
        page, _, anchor = target.partition("#")
        path = ROOT / page
        if not path.is_file() or (anchor and anchor not in anchors_of(path)):
            broken.append(f"{where}: {target}")
    return broken


def test_the_readme_links_resolve() -> None:
    links = re.findall(r"\]\(((?:docs/)[^)\s]+)\)", README.read_text())
    assert "docs/operator/vllm.md" in links
    assert broken_targets([("README.md", link) for link in links]) == []


def test_code_cites_pages_that_exist() -> None:
    """Docstrings and comments cite docs/ pages by path (and anchor); each must resolve."""
    citations: list[tuple[str, str]] = []
    stale: list[str] = []
    for folder in ("client", "server", "integrations", "tools", "bench", "tests", "deploy"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".yaml", ".yml") or path == Path(__file__):
                continue
            text = path.read_text()
            where = str(path.relative_to(ROOT))
            citations += [(where, m) for m in re.findall(r"docs/[\w/-]+\.md(?:#[\w-]+)?", text)]
            if re.search(r"design\.md §|design §\d", text):
                stale.append(where)
    assert stale == [], f"cite a page of docs/ instead of docs/design.md's sections: {stale}"
    assert any(target == "docs/design/step.md" for _, target in citations)
    assert broken_targets(citations) == []


def test_a_stale_citation_is_caught() -> None:
    cited = [("a.py", "docs/design/step.md#no-such-anchor"), ("b.py", "docs/design.md")]
    assert broken_targets(cited) == [
        "a.py: docs/design/step.md#no-such-anchor",
        "b.py: docs/design.md",
    ]
    assert broken_targets([("c.py", "docs/design/step.md#bucket-aware-compaction")]) == []


def test_no_history_in_the_docs() -> None:
    """The docs say what is, not what was: no changelog paragraphs."""
    history = re.compile(r"before this round|this round|used to|\(before[:,]", re.I)
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)!r}"
        for path in doc_files()
        for match in history.finditer(path.read_text())
    ]
    assert found == []


def mkdocs_build(root: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", "site"]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)


@pytest.fixture
def site_copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    return tmp_path


@pytest.mark.slow
def test_the_site_builds_strict(site_copy: Path) -> None:
    result = mkdocs_build(site_copy)
    assert result.returncode == 0, result.stderr
    assert (site_copy / "site" / "operator" / "run-directory" / "index.html").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ("[x](../design/step.md#no-such-anchor)", "does not contain an anchor '#no-such-anchor'"),
        ("[x](no-such-page.md)", "not found among documentation files"),
        (None, 'not included in the "nav"'),
    ],
    ids=["stale anchor", "broken link", "page not in the nav"],
)
def test_a_broken_link_fails_the_build(site_copy: Path, change: str | None, complaint: str) -> None:
    page = site_copy / "docs" / "operator" / "vllm.md"
    if change is None:
        (site_copy / "docs" / "orphan.md").write_text("# An orphan\n")
    else:
        page.write_text(page.read_text() + f"\nSee {change}.\n")
    result = mkdocs_build(site_copy)
    assert result.returncode != 0
    assert complaint in result.stderr
