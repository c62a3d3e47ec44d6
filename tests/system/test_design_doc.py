"""docs/design.md keeps the numbered sections that code, tests and the README cite."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
SECTIONS = {
    1: "The problem",
    2: "Architecture",
    3: "Vocabulary",
    4: "The step",
    5: "Sessions and faults",
    6: "API surface",
    7: "Metrics",
    8: "Configuration",
    9: "KV access contract and lock order",
    10: "Error table",
    11: "Packages",
    12: "What a step costs",
    13: "The vLLM integration",
}


def _headings() -> dict[int, str]:
    found = re.findall(r"^## (\d+)\. (.+)$", DESIGN.read_text(), re.MULTILINE)
    return {int(number): title for number, title in found}


def test_numbered_sections_keep_their_numbers() -> None:
    assert _headings() == SECTIONS


def test_every_cited_section_exists() -> None:
    paths = [ROOT / "README.md"]
    for folder in ("client", "server", "integrations", "bench", "tests"):
        paths += (ROOT / folder).rglob("*.py")
    cited: set[tuple[str, int]] = set()
    for path in paths:
        for number in re.findall(r"design(?:\.md)? §(\d+)", path.read_text()):
            cited.add((str(path.relative_to(ROOT)), int(number)))
    assert cited, "nothing cites docs/design.md by section"
    missing = sorted((name, number) for name, number in cited if number not in SECTIONS)
    assert not missing, f"cited sections that docs/design.md does not have: {missing}"
