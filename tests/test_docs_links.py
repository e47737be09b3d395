"""The documentation holds together: links resolve, the README stays a front page, every report
folder is indexed, and the text cites the repository (design sections, tests, results), never a
tracker's issue numbers."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README_MAX_LINES = 300
# The two long pages, held where they are now so that they only shrink: design.md is architecture,
# math and interfaces (the wire, precision and memory, checkpoints and failure behaviour have pages
# of their own, usage is in docs/usage.md, the test inventory in tests/README.md); results.md holds
# the current figures (history in docs/results/archive/). Aimed at: about 700 and 300 lines.
PAGE_MAX_LINES = {"docs/design.md": 766, "docs/results.md": 337}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
ISSUE_NUMBER = re.compile(r"\bissues? ?#?[0-9]|the issue's", re.IGNORECASE)
# Files whose text must not cite issue numbers: everything a reader of the repository sees.
NO_ISSUE_NUMBERS_IN = ("README.md", "docs/", "benchmarks/", "examples/", "deepspeed_acco/", "tests/")
# This test's own file spells the pattern out to check it.
NO_ISSUE_NUMBERS_EXCEPT = ("tests/test_docs_links.py", )
# Words about how the work was done rather than about the project: a page tells a user what to run
# ("on a machine with a GPU, run bash benchmarks/gpu_check.sh"), not which machine was borrowed.
WORKPLACE_WORDS = ("lent", "device tool", "device time", "session", "sessions", "borrowed", "issue #")
WORKPLACE_WORD = re.compile("|".join(r"(?<!\w)" + re.escape(w) + (r"(?!\w)" if w[-1].isalnum() else "")
                                     for w in WORKPLACE_WORDS), re.IGNORECASE)


def markdown_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "benchmarks").rglob("*.md"))


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen, found = {}, set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = None if in_code else HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path):
    in_code = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for match in LINK.finditer(line):
            target = match.group(1)
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            yield number, target


def test_markdown_links_resolve():
    broken = []
    for path in markdown_files():
        for number, target in links(path):
            file_part, _, anchor = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not destination.exists():
                broken.append(f"{where} (no such file or folder)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{where} (no heading with anchor #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [missing](nowhere.md) [bad anchor](page.md#nope)\n")
    found = {target for _, target in links(page)}
    assert found == {"page.md#title", "nowhere.md", "page.md#nope"}
    assert anchors(page) == {"title"}
    assert not (tmp_path / "nowhere.md").exists()


def test_slug_follows_github():
    assert slug("At what loss?") == "at-what-loss"
    assert slug("`make demo`: two nodes at 1 Gbit/s") == "make-demo-two-nodes-at-1-gbits"
    assert slug("HF Trainer and Accelerate") == "hf-trainer-and-accelerate"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it at most {README_MAX_LINES} and move details to docs/")


def headline_table(readme: str):
    """The README's "Results" section: the report it cites and the rows of its first table."""
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    report = re.search(r"\]\((docs/results/[^)#]+/results\.md)\)", section).group(1)
    table = section[section.index("\n| "):]
    rows = []
    for line in table.splitlines()[1:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return report, rows[2:]  # past the header and the separator


def test_the_readmes_headline_figures_are_in_the_report_it_cites():
    report, rows = headline_table((ROOT / "README.md").read_text(encoding="utf-8"))
    text = (ROOT / report).read_text(encoding="utf-8")
    assert len(rows) >= 3, rows
    for row in rows:
        for cell in row[1:]:
            for figure in re.findall(r"[+-]?\d+\.\d+[x%]?|\b\d{3,}\b", cell):
                assert figure in text, f"README's {row[0]!r} row quotes {figure}, which {report} does not contain"


def test_a_figure_missing_from_the_report_is_found(tmp_path):
    readme = ("# Page\n\n## Results\n\n[r](docs/results/x/results.md)\n\n| method | ms |\n|---|---:|\n| A | 501 |\n"
              "| B | 1.41x |\n\n## Next\n")
    report, rows = headline_table(readme)
    assert report == "docs/results/x/results.md" and rows == [["A", "501"], ["B", "1.41x"]]


@pytest.mark.parametrize("page", sorted(PAGE_MAX_LINES))
def test_long_pages_do_not_grow(page):
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    assert len(lines) <= PAGE_MAX_LINES[page], (
        f"{page} has {len(lines)} lines; keep it at most {PAGE_MAX_LINES[page]}: move usage to docs/usage.md, "
        "history to docs/results/archive/, test descriptions to tests/README.md")


def indexed_folders():
    folders = [p for p in RESULTS.iterdir() if p.is_dir() and p.name != "archive"]
    archive = RESULTS / "archive"
    if archive.is_dir():
        folders += [p for p in archive.iterdir() if p.is_dir()]
    return sorted(folders)


def test_results_index_names_every_folder():
    index = (RESULTS / "README.md").read_text(encoding="utf-8")
    linked = {target.partition("#")[0].rstrip("/") for _, target in links(RESULTS / "README.md")}
    missing = [str(p.relative_to(RESULTS)) for p in indexed_folders()
               if str(p.relative_to(RESULTS)) not in linked]
    assert not missing, ("docs/results/README.md does not link these report folders; add a row with the "
                         "question, the command and the date: " + ", ".join(missing))
    assert "archive/" in index


def tracked_text_files():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        if not name or not name.startswith(NO_ISSUE_NUMBERS_IN) or name in NO_ISSUE_NUMBERS_EXCEPT:
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:4096]:
            continue
        yield name, data.decode("utf-8", errors="replace")


def test_no_issue_numbers_in_docs():
    try:
        files = list(tracked_text_files())
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    assert files, "no tracked documentation files found"
    hits = [f"{name}:{number}: {line.strip()}" for name, text in files
            for number, line in enumerate(text.splitlines(), 1) if ISSUE_NUMBER.search(line)]
    assert not hits, ("cite a docs/design.md section, a test or a docs/results.md section instead of "
                      "an issue:\n" + "\n".join(hits))


def test_issue_pattern_matches_what_it_must():
    assert ISSUE_NUMBER.search("as issue 16 asks")
    assert ISSUE_NUMBER.search("see issue #3")
    assert ISSUE_NUMBER.search("the issue's target")
    assert not ISSUE_NUMBER.search("the job issues collectives in program order")


def user_pages():
    """Every page a user reads: README.md, docs/ (report folders included) and benchmarks/*.md."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "benchmarks").glob("*.md"))


def test_pages_speak_only_of_the_project():
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in user_pages()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if WORKPLACE_WORD.search(line)]
    assert not hits, ("say what a user runs and where (\"on a machine with a GPU\"), not how the work was "
                      "done:\n" + "\n".join(hits))


def test_workplace_words_match_what_they_must():
    for text in ("when a GPU is lent", "through the Device Tool", "15 minutes of device time",
                 "to fit the session", "other sessions' tests", "a borrowed H200", "see issue #4"):
        assert WORKPLACE_WORD.search(text), text
    for text in ("the job issues collectives", "relentless", "the excellent result", "a GPU's time",
                 "possession", "lentil"):
        assert not WORKPLACE_WORD.search(text), text
