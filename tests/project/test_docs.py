"""The README is a newcomer's first ten minutes and docs/ holds the rest: the README stays
short and free of one machine's timings, names the two commands as they are, and every
relative link of the README, docs/ and benchmarks/RESULTS.md leads to a file and heading
that exist; every docs/ page is one click from the README or the docs index."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks, lines joined (a link may wrap)."""
    return re.sub(r"\s*\n\s*", " ", re.sub(r"```.*?```", "", text, flags=re.S))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not t.startswith("http")]


def test_the_readme_is_short_and_names_the_two_commands_as_they_are():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in text
        assert (ROOT / command.split()[1]).is_file()


def test_the_readme_carries_no_timing_measured_on_a_machine():
    timings = re.findall(r"\b\d+(?:\.\d+)?\s?(?:s|ms|µs|min|seconds|minutes)\b",
                         README.read_text())
    assert not timings, f"measured figures belong in benchmarks/RESULTS.md: {timings}"


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_one_click_from_the_readme_or_the_docs_index():
    linked = set()
    for page in (README, ROOT / "docs" / "README.md"):
        for target in _links(page):
            path = target.partition("#")[0]
            if path:
                linked.add((page.parent / path).resolve())
    assert (ROOT / "docs" / "README.md").resolve() in linked
    assert (ROOT / "benchmarks" / "RESULTS.md").resolve() in linked
    missing = [p.name for p in (ROOT / "docs").glob("*.md")
               if p.name != "README.md" and p.resolve() not in linked]
    assert not missing, missing


def test_every_module_or_name_of_ours_that_a_doc_or_docstring_names_exists():
    # A module that moved or a name that went leaves its old spelling behind in prose; a
    # reader who looks it up finds nothing. (`trainer.X`, `trainer.py`: placeholders, files.)
    import importlib

    pattern = re.compile(r"`((?:ckpt_assets|trainer|ckpt_trainer)(?:\.[A-Za-z_]\w*)+)")
    missing = set()
    for path in [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"),
                 *(ROOT / "trainer").rglob("*.py"), *(ROOT / "ckpt_assets").rglob("*.py")]:
        for ref in pattern.findall(path.read_text()):
            parts = ref.split(".")
            if parts[-1] in ("py", "X"):
                continue
            for i in range(len(parts), 0, -1):
                try:
                    found = importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    continue
                for name in parts[i:]:  # a dataclass's field is an annotation, not an attribute
                    found = getattr(found, name, None) if name not in getattr(
                        found, "__annotations__", {}) else name
                if found is None:
                    missing.add(f"{path.relative_to(ROOT)}: {ref}")
                break
    assert sorted(missing) == []
