"""The README and docs/: the front page stays short and names the commands CI runs, every docs
page is listed on it, and every relative link and image in them points at a file (and heading)
that exists; the suite's file order names files that exist. Text only: no JAX, under a
second."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("pip install -r requirements.txt && python launch/train.py --config=configs/bandit.py:cpu",
            "pip install -r requirements.txt && python -m pytest")


def _prose(text):
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _anchors(path):
    """GitHub's heading ids: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", _prose(path.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_readme_is_a_short_front_page_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for command in COMMANDS:
        assert command in text
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text()  # what CI's newcomer step runs
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in text, f"docs/{page.name} is not listed in the README"


def test_every_relative_link_and_image_resolves():
    bad = []
    for page in PAGES:
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_the_suites_longest_first_order_names_test_files():
    """tests/conftest.py's FILES_LONGEST_FIRST: a name that is no test file (a rename) would
    quietly put that file back among the short ones at the end of the schedule."""
    from tests.conftest import FILES_LONGEST_FIRST

    assert len(set(FILES_LONGEST_FIRST)) == len(FILES_LONGEST_FIRST)
    for name in FILES_LONGEST_FIRST:
        assert (ROOT / "tests" / name).is_file(), name
