"""Checks the README and docs/: every relative link and image resolves (the file exists and, for
#anchors, the target has a heading with that GitHub slug), and the README's test command is the
one .ci/run runs. Standard library only:

    python docs/check_links.py
"""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set:
    found, fence = set(), False
    for line in open(path):
        if line.startswith("```"):
            fence = not fence
        m = re.match(r"^#+ (.*)", line)
        if m and not fence:
            found.add(slug(m.group(1)))
    return found


def main() -> int:
    problems, links = [], 0
    for f in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        text = re.sub(r"```.*?```", "", open(f).read(), flags=re.S)  # links in code blocks are text
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            links += 1
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            where = os.path.relpath(f, ROOT)
            if not os.path.exists(dest):
                problems.append(f"{where}: {target} does not exist")
            elif anchor and anchor not in anchors(dest):
                problems.append(f"{where}: {target}: no heading with that anchor")
    ci = [l.strip() for l in open(os.path.join(ROOT, ".ci", "run")) if l.strip() and not l.startswith("#")]
    readme = [l.strip() for l in open(os.path.join(ROOT, "README.md"))]
    if not any("pytest" in line and line in readme for line in ci):  # then the arithmetic orders and style
        problems.append(".ci/run runs no pytest command that is a line of the README (the test command "
                        "must match)")
    print("\n".join(problems + [f"{links} relative links checked, {len(problems)} problems"]))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
