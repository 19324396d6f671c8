"""The side-by-side diffs of the method files, as HTML pages under docs/: costa.py against cpdae.py and against
seed.py. The three files share a skeleton section for section, so a diff shows what each method changes.

    python -m lab.diffs            # write docs/diff-costa-cpdae.html and docs/diff-costa-seed.html
    python -m lab.diffs --check    # exit 1 if a page is not what the method files give now
"""
import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"docs/diff-costa-cpdae.html": ("costa.py", "cpdae.py"), "docs/diff-costa-seed.html": ("costa.py", "seed.py")}
STYLE = "table.diff {font-family: monospace; font-size: 12px} td {vertical-align: top}"


class PageDiff(difflib.HtmlDiff):
    def _make_prefix(self):
        """The anchors' names, the same on every page: difflib numbers them by how many tables the process made
        before, so a page would depend on which other pages were made first."""
        self._prefix = ["from_", "to_"]


def page(old, new):
    """The HTML page of the diff of ROOT/old and ROOT/new: the changed lines with 3 lines of context, side by side,
    lines wrapped at 100 characters."""
    a, b = ((ROOT / name).read_text().splitlines() for name in (old, new))
    text = PageDiff(tabsize=4, wrapcolumn=100).make_file(a, b, old, new, context=True, numlines=3, charset="utf-8")
    header = (f"<h2>{old} vs {new}</h2>\n    <p>Written by <code>python -m lab.diffs</code> (lab/diffs.py): what "
              f"{new} changes of {old}'s skeleton, with 3 lines of context.</p>")
    return (text.replace("<title></title>", f"<title>{old} vs {new}</title>")
                .replace("</style>", f"    {STYLE}\n    </style>")
                .replace("<body>", f"<body>\n    {header}", 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, (old, new) in PAGES.items():
        text = page(old, new)
        if args.check:
            current = (ROOT / path).read_text() if (ROOT / path).is_file() else None
            if current != text:
                stale.append(path)
        else:
            (ROOT / path).write_text(text)
            print(f"wrote {path}")
    if stale:
        sys.exit(f"out of date: {', '.join(stale)}; run python -m lab.diffs")
    if args.check:
        print(f"current: {', '.join(PAGES)}")


if __name__ == "__main__":
    main()
