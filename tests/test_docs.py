"""The documentation holds together: the README's first screen says what
Baton is and gives the two commands; every file of docs/ is in its index;
every relative link (file and #anchor) in the README and docs/ resolves;
every `docs/<name>.md` the repository cites exists, and nothing cites a
top-level design file the repository does not have (it is docs/design.md,
with the same section numbers)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED = re.compile(r"\bdocs/([\w-]+\.md)")
FIRST_SCREEN_LINES = 50


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to
    hyphens."""
    found = set()
    for line in prose(path.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_the_first_screen_says_what_baton_is_and_gives_the_two_commands() -> None:
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN_LINES])
    assert "Baton runs long-lived AI-agent **sessions**" in first
    assert "apt-get install -y etcd-server && pip install -e . && baton up --demo" in first
    assert "pip install -e '.[dev]' -e ./sdk && python -m pytest" in first
    assert re.search(r"The tests take about \d+ minutes", first), first


def test_every_doc_is_in_the_index() -> None:
    index = (DOCS / "README.md").read_text()
    for path in DOCS.glob("*.md"):
        if path.name != "README.md":
            assert f"]({path.name})" in index, f"docs/README.md does not list {path.name}"


def test_every_relative_link_resolves() -> None:
    broken = []
    for path in markdown_files():
        for target in LINK.findall(prose(path.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def tracked_text() -> dict[str, str]:
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    texts = {}
    for name in names:
        path = ROOT / name
        if path.suffix in {".py", ".pyi", ".md", ".proto", ".yaml", ".json", ".sh", ".toml"}:
            if path.is_file():
                texts[name] = path.read_text(errors="replace")
    return texts


def test_cited_docs_exist_and_nothing_cites_design_md() -> None:
    texts = tracked_text()
    assert "tests/test_docs.py" in texts
    missing = sorted(
        f"{name}: docs/{doc}"
        for name, text in texts.items()
        for doc in CITED.findall(text)
        if not (DOCS / doc).exists()
    )
    assert not missing, missing
    stale = "DESIGN" + ".md"  # spelled apart so this file does not cite it
    citing = sorted(name for name, text in texts.items() if stale in text)
    assert not citing, citing
