"""README.md and docs/: the README stays short, every relative link (and #anchor) resolves
inside the repository, no path leads outside it, and every page in docs/ is reachable
from the README."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 350

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")          # https:, mailto:, ...
# a path that leads outside a clone of the repository: the development machine's shared
# folder beside the checkout, or an absolute path into its work folder
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.~-])/work\b")


def _pages():
    docs = sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))
    return [README] + docs


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (where links are not links)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set:
    seen, anchors = {}, set()
    fenced = False
    for line in open(path, encoding="utf-8").read().split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: str):
    """(line number, target) of every relative link and image in a page's prose."""
    prose = _prose(open(path, encoding="utf-8").read())
    for k, line in enumerate(prose.split("\n"), 1):
        for m in LINK.finditer(line):
            target = m.group(1)
            if not EXTERNAL.match(target):
                yield k, target


def test_readme_is_short():
    n = len(open(README, encoding="utf-8").read().rstrip("\n").split("\n"))
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, more than {README_MAX_LINES}: move detail to a page in docs/")


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for page in _pages():
        for line, target in _links(page):
            where = f"{_rel(page)}:{line}: ({target})"
            file_part, _, anchor = target.partition("#")
            dest = page if not file_part else os.path.normpath(
                os.path.join(os.path.dirname(page), file_part))
            if os.path.commonpath([ROOT, os.path.realpath(dest)]) != ROOT:
                broken.append(f"{where} leads outside the repository")
            elif not os.path.exists(dest):
                broken.append(f"{where} names a file that does not exist")
            elif anchor:
                if not dest.endswith(".md"):
                    broken.append(f"{where} has an anchor on a file that is not markdown")
                elif anchor not in _anchors(dest):
                    broken.append(f"{where} names no heading of {_rel(dest)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_path_outside_the_repository():
    found = []
    for page in _pages():
        for k, line in enumerate(open(page, encoding="utf-8").read().split("\n"), 1):
            for m in OUTSIDE.finditer(line):
                found.append(f"{_rel(page)}:{k}: '{m.group(0)}' in: {line.strip()[:100]}")
    assert not found, ("paths a clone of the repository does not have:\n"
                       + "\n".join(found))


def test_every_docs_page_is_linked_from_the_readme():
    linked = set()
    for _, target in _links(README):
        file_part = target.partition("#")[0]
        if file_part:
            linked.add(os.path.normpath(os.path.join(ROOT, file_part)))
    pages = [p for p in _pages() if p != README]
    unlinked = [_rel(p) for p in pages if os.path.normpath(p) not in linked]
    assert not unlinked, f"pages in docs/ the README does not link: {unlinked}"


def test_the_checks_see_what_they_check():
    """The helpers themselves: a link in code is not a link, anchors are GitHub's."""
    assert _slug("`dhelix plan`, `dhelix simulate`, `dhelix plan-sweep`") == \
        "dhelix-plan-dhelix-simulate-dhelix-plan-sweep"
    assert _slug("The fold (pipeline parallelism)") == "the-fold-pipeline-parallelism"
    assert "](x.md)" not in _prose("`[a](x.md)`\n```\n[b](x.md)\n```")
    assert OUTSIDE.search("see ../shared/DESIGN.md") and OUTSIDE.search("at /work/main")
    assert not OUTSIDE.search("a network/workload, the framework")
    assert len(_pages()) > 5 and any(True for _ in _links(README))
