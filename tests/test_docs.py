"""The docs stand on their own and say what the code says: generated sections (exit codes, the reasons
PagedAttention is not used) match their tables in the code; no doc cites a file outside the repository."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpact.shared import reasons
from kvpact.shared.exit_codes import EXIT_CODES

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def test_generated_sections_are_up_to_date():
    result = subprocess.run(
        [sys.executable, "tools/render_docs.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_generated_table_is_in_the_docs():
    contract = (ROOT / "docs" / "contract.md").read_text()
    for r in reasons.REASONS:
        assert f"| {r.name} | `{r.code}` | `{r.component}` |" in contract
    for doc in (ROOT / "README.md", ROOT / "docs" / "contract.md"):
        text = doc.read_text()
        for e in EXIT_CODES:
            assert f"| {e.code} | {e.router} | {e.worker} |" in text, doc.name


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_cite_nothing_outside_the_repository(doc):
    bad = re.findall(r"\.\./shared|(?<![\w/])reference/|DESIGN\.md|STYLE\.md", doc.read_text())
    assert not bad, f"{doc.name} cites {bad}: say it here instead"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_between_the_docs_lands(doc):
    """A relative link names a file that exists and, with #anchor, a heading in it (pages moved between
    README.md and docs/ keep their links)."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{doc.name}: {broken}"


def test_slug_matches_github():
    assert slug("Is it up? `router status` and health") == "is-it-up-router-status-and-health"
    assert slug("Fitting the model to memory: `--max-model-len auto`") == (
        "fitting-the-model-to-memory---max-model-len-auto"
    )


def test_the_code_cites_nothing_outside_the_repository():
    """Docstrings, comments and config cite docs/design.md, never a design card or write-up kept elsewhere."""
    cited = re.compile(r"DESIGN(?:\.md|\s*§)|seed[ ]write-up|\.\./shared/")
    paths = [ROOT / "pyproject.toml", ROOT / "Makefile"]
    for part in ("shared", "router", "worker", "kernels", "deploy", "protos", "tests", "benchmarks", "tools"):
        paths += (ROOT / part).rglob("*.py")
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in paths for m in cited.findall(p.read_text())]
    assert not bad, "cite docs/design.md instead:\n" + "\n".join(bad)


def test_every_reason_is_raised_somewhere():
    """A reason in the table that no check uses would be documented but never given (the router gives
    the ones found while serving, router/drift.py)."""
    code = "\n".join(p.read_text() for d in ("shared", "worker", "router") for p in (ROOT / d).rglob("*.py"))
    names = [n for n, v in vars(reasons).items() if isinstance(v, reasons.Reason)]
    assert len(names) == len(reasons.REASONS)
    unused = [n for n in names if not re.search(rf"\b{n}\.(message|component|found)\b", code)]
    assert not unused, unused
