"""The manual: every relative link in README.md and docs/*.md resolves (files and #anchors), the Python examples
run, and docs/cli.md is what the commands' --help prints today."""

import re
from pathlib import Path

import pytest

from vlfit.commands import cli_reference

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# docs/python-api.md's first example trains a model: tests/test_api.py runs it (test_the_readme_example_runs);
# docs/serving.md's asks a server: tests/serve/test_openai_embeddings.py runs it against one.
RUN_ELSEWHERE = {("docs/python-api.md", 0), ("docs/serving.md", 0)}

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose_lines(text: str) -> list[str]:
    """The lines of a page outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, -1, -2 ...
    after repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative_links(page: Path) -> list[str]:
    targets = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        targets += [t for t in LINK.findall(line) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:
    return targets


def _python_examples() -> list[tuple[str, int, str]]:
    examples = []
    for page in PAGES:
        blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)
        examples += [(page.relative_to(ROOT).as_posix(), i, code) for i, code in enumerate(blocks)]
    return examples


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            name = page.relative_to(ROOT)
            if not resolved.exists():
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{name}: {target} (no heading with anchor #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert len(PAGES) > 10  # the manual is there


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    linked = {target.partition("#")[0] for target in _relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in linked]
    assert not unlinked, f"docs pages the README's index does not list: {unlinked}"


@pytest.mark.parametrize(
    "page,number,code",
    [
        pytest.param(*example, id=f"{example[0]}:{example[1]}")
        for example in _python_examples()
        if example[:2] not in RUN_ELSEWHERE
    ],
)
def test_python_examples_run(page, number, code, synthetic_dataset_dir, tmp_path, monkeypatch):
    (tmp_path / "data").symlink_to(synthetic_dataset_dir)  # the examples' dataset_name="data"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page} (example {number + 1})", "exec"), {})


def test_the_python_api_example_is_run_by_test_api():
    assert {example[:2] for example in _python_examples()} >= RUN_ELSEWHERE


def test_cli_reference_is_up_to_date():
    page = ROOT / "docs" / "cli.md"
    expected = cli_reference.render()
    assert page.is_file() and page.read_text(encoding="utf-8") == expected, (
        f"docs/cli.md is stale: a command's flags or help changed; regenerate it with `{cli_reference.REGENERATE}`"
    )
