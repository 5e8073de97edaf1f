"""Every repository path that the docs, the Dockerfile, pyproject.toml and the code's docstrings and
comments name exists, so a moved or deleted file cannot leave a reader on a dead trail.

What counts as a path (the rule):
- a file path: a token that begins with one of the top-level folders (ROOTS) followed by `/`, runs
  over letters, digits, `_ . / -`, and ends in one of EXTENSIONS, e.g. `model/ops/naive.py`;
- a folder path: the same, ending in `/`, e.g. `server/engine/`;
- a dotted module: `linstream.`, `benchmarks.`, `harness.` or `tests.` followed by names, e.g.
  `benchmarks.serving.cold_start` or `linstream.model.lm.LM.step`. Its names are followed as
  folders and modules while they lead to one; a name after a module is an attribute (not checked),
  a name after a package must be a module of it or appear in its `__init__.py`.
- a section: a path to a .md file (or, in the docs, a sibling's name such as `models.md`) followed by
  `#anchor` names a heading of that file, as GitHub makes anchors of headings.
The folders of the installed package are mapped as pyproject.toml's package-dir maps them:
`linstream.model` (and `linstream/model/`) is the folder `model/`, `linstream.server` is `server/`,
`linstream.clients` is `clients/`.
Not paths: tokens with a pattern or a placeholder in them (`*`, `{`, `<`, `$`, `...`), a token glued
to a word before it (`foo/model/x.py`, a URL), and, in the benchmarks' own code, the results they
write (benchmarks/results/..., named before the first run makes them). Anywhere else a result is a
path like any other, so the docs quote only results that are committed.

Where it looks (SOURCES): docs/*.md, README.md, Dockerfile, pyproject.toml (all of it: its paths
stand in comments), and the docstrings and comments of the *.py files under the code's folders.
"""
from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("server", "model", "clients", "linstream", "tests", "docs", "benchmarks", "harness", "deploy")
EXTENSIONS = ("py", "md", "json", "cpp", "yaml", "yml", "cfg", "toml", "sh", "txt", "png", "csv", "js", "html", "css")
CODE_DIRS = ("server", "model", "clients", "linstream", "harness", "benchmarks", "tests")
PACKAGE_DIR = {"linstream/model": "model", "linstream/server": "server", "linstream/clients": "clients"}
OUTPUTS = {"benchmarks/": "benchmarks/results/"}  # code under the key names files a run makes under the value

FILE_OR_DIR = re.compile(
    r"(?<![\w./-])((?:%s)/[\w./-]*?(?:\.(?:%s)\b|/))(?![\w*{<$])" % ("|".join(ROOTS), "|".join(EXTENSIONS)))
DOTTED = re.compile(r"(?<![\w./-])((?:linstream|benchmarks|harness|tests)(?:\.[A-Za-z_]\w*)+)")
PLACEHOLDER = re.compile(r"[*{}<>$]|\.\.\.")
SECTION = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*?\.md|[\w-]+\.md)#([\w-]+)" % "|".join(ROOTS))


def sources() -> list[Path]:
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "Dockerfile", ROOT / "pyproject.toml"]
    for d in CODE_DIRS:
        files += sorted(p for p in (ROOT / d).rglob("*.py") if "results" not in p.relative_to(ROOT).parts)
    return [f for f in files if f != Path(__file__).resolve()]  # this file's examples name missing paths on purpose


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a file says to a reader: a whole doc, or a .py file's docstrings and comments."""
    text = path.read_text()
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):  # docstrings, help texts, messages: every string literal
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out += [(node.lineno + i, line) for i, line in enumerate(node.value.splitlines())]
    return out


def mapped(rel: str) -> Path:
    for installed, folder in PACKAGE_DIR.items():
        if rel == installed or rel.startswith(installed + "/"):
            rel = folder + rel[len(installed):]
    return ROOT / rel


def file_exists(token: str, named_in: str) -> bool:
    token = token.rstrip(".")  # a sentence's full stop after a folder
    if any(named_in.startswith(code) and token.startswith(out) for code, out in OUTPUTS.items()):
        return True
    p = mapped(token)
    return p.is_dir() if token.endswith("/") else p.exists()


def is_module_name(dotted: str) -> bool:
    """A file name (`benchmarks.md`, `linstream.yaml`) is not a module; nor are the two-name
    `linstream.<x>` that name loggers (`linstream.engine`) and ASGI scope keys (`linstream.route`)."""
    names = dotted.split(".")
    return names[-1] not in EXTENSIONS and (names[0] != "linstream" or len(names) > 2 or names[1] in ("model", "server", "clients", "cli", "cluster"))


def module_exists(dotted: str) -> bool:
    names = dotted.split(".")
    rel = names[0]
    for name in names[1:]:
        if mapped(f"{rel}/{name}").is_dir():
            rel = f"{rel}/{name}"
        elif mapped(f"{rel}/{name}.py").is_file():
            return True  # the names after a module are its attributes
        else:  # a name a package's __init__.py defines or hands on
            init = mapped(f"{rel}/__init__.py")
            return "/" in rel and init.is_file() and re.search(rf"\b{re.escape(name)}\b", init.read_text()) is not None
    return True


@functools.cache
def anchors(md: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces as '-'."""
    heads = (re.match(r"#{1,6}\s+(.*)", line) for line in md.read_text().splitlines())
    return {re.sub(r"[^\w\- ]", "", h.group(1).strip().lower()).replace(" ", "-") for h in heads if h}


def section_exists(file: str, anchor: str, named_in: Path) -> bool:
    md = mapped(file) if "/" in file else (named_in.parent if named_in.suffix == ".md" else ROOT / "docs") / file
    return not md.exists() or anchor in anchors(md)  # a missing file is reported as a path


def missing_paths() -> list[str]:
    found = []
    for path in sources():
        for line, text in prose(path):
            rel = str(path.relative_to(ROOT))
            where = f"{rel}:{line}"
            for m in FILE_OR_DIR.finditer(text):
                if not PLACEHOLDER.search(m.group(1)) and not file_exists(m.group(1), rel):
                    found.append(f"{where}: {m.group(1)}")
            for m in SECTION.finditer(text):
                if not section_exists(m.group(1), m.group(2), path):
                    found.append(f"{where}: {m.group(1)}#{m.group(2)}")
            for m in DOTTED.finditer(text):
                if is_module_name(m.group(1)) and not module_exists(m.group(1)):
                    found.append(f"{where}: {m.group(1)}")
    return found


def test_named_paths_exist():
    missing = missing_paths()
    assert not missing, "paths named in docs, docstrings or comments that do not exist:\n" + "\n".join(missing)


def test_the_rule():
    """What counts as a path, and the package-dir mapping, on a few examples."""
    text = "see model/ops/naive.py, server/engine/ and http://host/model/a.py, not model/<name>.py"
    assert [m.group(1) for m in FILE_OR_DIR.finditer(text) if not PLACEHOLDER.search(m.group(1))] == \
        ["model/ops/naive.py", "server/engine/"]
    assert file_exists("linstream/model/lm.py", "docs/architecture.md") and not file_exists("model/gone.py", "README.md")
    assert file_exists("benchmarks/results/serving/new.json", "benchmarks/serving/new.py")  # an output, named by its program
    assert module_exists("linstream.model.lm.LM.step") and module_exists("benchmarks.serving.cold_start")
    assert not module_exists("linstream.model.gone") and not is_module_name("linstream.engine")  # a logger's name
    docs = ROOT / "docs" / "architecture.md"
    assert section_exists("models.md", "the-mixers", docs) and not section_exists("docs/reliability.md", "gone", docs)
