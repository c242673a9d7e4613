"""The code in the documentation runs: every ```python block of docs/*.md and of the README.

Each page's runnable blocks run in order in one namespace (a later block may use what an
earlier one defined), in a fresh namespace per page. A block that cannot run here (a fragment
that needs your data loader, a process group, a whole example script) is marked on the line
before its fence with ``<!-- docs-test: skip: REASON -->``; the reason is required. Relative
links of the pages must point at files of the repository (they are followed on GitHub too).
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# README.new.md is the shortened README until it is swapped in as README.md.
README = ROOT / "README.new.md" if (ROOT / "README.new.md").exists() else ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md")) + [README]

FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!-- docs-test: skip:(.*)-->\s*$")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def blocks(page):
    """[(language, first line number, code, skip reason or None)] of a Markdown page."""
    out, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            start, lang = i, m.group(1)
            i += 1
            while i < len(lines) and lines[i].rstrip() != "```":
                i += 1
            prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            skip = SKIP.match(prev)
            out.append((lang, start + 1, "\n".join(lines[start + 1:i]),
                        skip.group(1).strip() if skip else None))
        i += 1
    return out


def _id(page):
    return page.relative_to(ROOT).as_posix()


RUNNABLE = [p for p in PAGES if any(lang == "python" and skip is None
                                    for lang, _, _, skip in blocks(p))]


def test_pages_found():
    assert len(PAGES) > 20, "docs/*.md missing"
    assert RUNNABLE, "no runnable python block in the docs"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_skips_state_a_reason(page):
    for lang, line, code, skip in blocks(page):
        if skip is not None:
            assert skip, f"{_id(page)}:{line}: a docs-test skip without a reason"
        if "--8<--" in code:
            assert skip, f"{_id(page)}:{line}: an included file must be marked as not run here"


@pytest.mark.parametrize("page", RUNNABLE, ids=_id)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                    # nothing a block writes lands in the checkout
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for lang, line, code, skip in blocks(page):
        if lang != "python" or skip is not None:
            continue
        try:
            exec(compile(code, f"{_id(page)}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the python block at {_id(page)}:{line} failed: {e!r}") from e


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_relative_links_exist(page):
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{_id(page)} links to {target}, which does not exist"


def test_every_example_has_a_page():
    # An example is a script whose docstring says how to run it; helper modules (char_text.py) are not.
    for script in sorted((ROOT / "examples").glob("*.py")):
        if f"python examples/{script.name}" not in script.read_text(encoding="utf-8"):
            continue
        page = DOCS / f"example-{script.stem.replace('_', '-')}.md"
        assert page.exists(), f"examples/{script.name} has no page ({page.name}, mkdocs.yml's nav)"
