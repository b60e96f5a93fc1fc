"""The code's structure: no import circles among speculant's modules, C headers that build on each other
in one direction, and no comment that names a path outside the repository.

All three checks read the source files only (nothing is imported or compiled), so they run in well under
a second.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "speculant"
KERNELS = PACKAGE / "kernels"


# -- Python: the module import graph -------------------------------------------------------------------

def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module under speculant/ by dotted name: (file, is a package's __init__)."""
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _known(name: str, mods: dict) -> str | None:
    """The longest prefix of `name` that is a speculant module (None for other packages)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts) or None


def import_graph() -> dict[str, set[str]]:
    """module -> the speculant modules it imports, anywhere in the file (function-local imports too).

    `from pkg import name` depends on pkg.name where that is a module, else on pkg (its __init__). The
    implicit import of a module's parent packages is not an edge: every submodule would close a circle
    with its package's __init__, which Python resolves by running the __init__ first.
    """
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            else:
                continue
            for target in targets:
                dep = _known(target, mods)
                if dep is not None and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each one or more import circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has ~100 nodes, far below the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    members = set(cycle)
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in cycle)


def test_cycle_finder_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_resolves_relative_and_local_imports():
    graph = import_graph()
    # bench/cli.py imports the shared options inside functions, relatively (`from ..cli_options import`)
    assert "speculant.cli_options" in graph["speculant.bench.cli"]
    assert "speculant.decoding.engine" in graph["speculant"]  # the package's __init__ re-exports the engine
    assert len(graph) > 50


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import circles among speculant modules:\n" + "\n\n".join(_describe(c, graph) for c in cycles)


# Package level: speculant's top-level modules and subpackages (heads, methods, models, ...) as nodes. No edge may
# close a circle between packages.
KNOWN_PACKAGE_EDGES: set[tuple[str, str]] = set()


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]], allowed=frozenset()) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module == "speculant":  # the root's re-exports would tie every package to every other
            continue
        src = _package(module)
        packages.setdefault(src, set()).update(
            _package(d) for d in deps if d != "speculant" and _package(d) != src and (module, d) not in allowed)
    return packages


def test_no_package_cycles():
    graph = import_graph()
    for edge in KNOWN_PACKAGE_EDGES:
        assert edge[1] in graph.get(edge[0], ()), f"{edge} is gone: delete it from KNOWN_PACKAGE_EDGES"
    packages = package_graph(graph, KNOWN_PACKAGE_EDGES)
    cycles = find_cycles(packages)
    assert not cycles, "import circles among speculant's packages:\n" + \
        "\n\n".join(_describe(c, packages) for c in cycles)


# -- C: the kernel headers, included into gq.c in one order -------------------------------------------

_FUNC = re.compile(r"^static\s[^;{=()]*?\b(\w+)\s*\(", re.M)


def _strip_c_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def backward_uses(kernels: Path, unit: str = "gq.c") -> list[str]:
    """Uses, in a header included into `unit`, of functions that a header included after it defines."""
    order = re.findall(r'^#include "(\w+\.h)"', (kernels / unit).read_text(), re.M)
    texts = {h: _strip_c_comments((kernels / h).read_text()) for h in order}
    defined_in = {}
    for h in order:
        for m in _FUNC.finditer(texts[h]):
            rest = texts[h][m.end():]
            depth, i = 1, 0  # skip the parameter list, then see whether a body or a ';' follows
            while depth and i < len(rest):
                depth += {"(": 1, ")": -1}.get(rest[i], 0)
                i += 1
            if rest[i:].lstrip().startswith("{"):
                defined_in.setdefault(m.group(1), h)
    backward = []
    for pos, h in enumerate(order):
        later = {name for name, where in defined_in.items() if order.index(where) > pos}
        used = set(re.findall(r"\b\w+\b", texts[h])) & later
        backward += [f"{h} uses {name} from {defined_in[name]}" for name in sorted(used)]
    return backward


def test_backward_uses_finds_a_forward_declaration(tmp_path):
    (tmp_path / "u.c").write_text('#include "a.h"\n#include "b.h"\n')
    (tmp_path / "a.h").write_text("static int g(int x); /* b.h */\nstatic int f(int x) { return g(x); }\n")
    (tmp_path / "b.h").write_text("static int g(int x) {\n    return x + 1;\n}\nstatic int h(void) { return f(1); }\n")
    assert backward_uses(tmp_path, "u.c") == ["a.h uses g from b.h"]
    (tmp_path / "a.h").write_text("static int f(int x) { return x; }\n")
    assert backward_uses(tmp_path, "u.c") == []


def test_kernel_headers_build_in_one_direction():
    """A header included into gq.c uses only what it or an earlier header defines: no forward
    declarations of a later header's functions, so the headers depend on each other one way."""
    backward = backward_uses(KERNELS)
    assert not backward, "kernel headers depend on headers included after them:\n" + "\n".join(backward)


# -- comments: no paths outside the repository --------------------------------------------------------

# absolute paths of a machine (a scratch script, a note, a build folder): they exist on no one else's
_OUTSIDE = re.compile(r"(?<![\w.~])/(?:work|tmp|home|root|mnt|Users|scratch)/")


def _python_comments(text: str) -> list[tuple[int, str]]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def _c_comments(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S)]


def _line_of(start: int, comment: str, offset: int) -> int:
    return start + comment.count("\n", 0, offset)


def _shell_comments(text: str) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        m = re.search(r"(?:^|\s)(#.*)$", line)  # a '#' opening a word: not $#, ${x#y} or a quoted '#'
        if m and line[:m.start(1)].count('"') % 2 == 0 and line[:m.start(1)].count("'") % 2 == 0:
            out.append((n, m.group(1)))
    return out


_READERS = {".py": _python_comments, ".c": _c_comments, ".h": _c_comments, ".sh": _shell_comments}


def comments_naming_outside_paths(files, root: Path = ROOT) -> list[str]:
    hits = []
    for path in files:
        reader = _READERS.get(path.suffix)
        if reader is None:
            continue
        for line, comment in reader(path.read_text(encoding="utf-8")):
            for m in _OUTSIDE.finditer(comment):
                hits.append(f"{path.relative_to(root)}:{_line_of(line, comment, m.start())}: {comment[max(0, m.start() - 40):m.end() + 40]!r}")
    return hits


def test_outside_path_finder_reads_comments_only(tmp_path):
    py = tmp_path / "a.py"
    py.write_text('"""Doc."""\nimport tempfile\nD = "/tmp/x"  # runtime value, not a comment\n'
                  '# measured with /work/notes/x.py\n')
    sh = tmp_path / "a.sh"
    sh.write_text('OUT=/tmp/out  # fine\necho "# /tmp/quoted"\n# see /home/me/notes\n')
    c = tmp_path / "a.c"
    c.write_text("int x = 1; /* /tmp/gemm.py: 3 ms */\n")
    hits = comments_naming_outside_paths([py, sh, c], tmp_path)
    assert len(hits) == 3, hits
    assert [h.split(":")[1] for h in hits] == ["4", "3", "1"]


def test_no_comment_names_a_path_outside_the_repo():
    files = sorted(p for d in (PACKAGE, ROOT / "scripts") for p in d.rglob("*") if p.suffix in _READERS)
    assert len(files) > 50
    hits = comments_naming_outside_paths(files)
    assert not hits, "comments naming paths outside the repository (name a script in scripts/ instead):\n" + \
        "\n".join(hits)


# -- comments that cite docs/measurements.md name one of its sections ---------------------------------

def cited_sections(text: str) -> list[str]:
    """The section names quoted after `docs/measurements.md` (a citation may wrap over comment lines)."""
    found = []
    for m in re.finditer(r'docs/measurements\.md[\s#*/]*"([^"]{1,120})"', text):
        found.append(re.sub(r"\s*(?:\n\s*(?:#|\*|//)?)\s*", " ", m.group(1)).strip())
    return found


def test_cited_sections_read_across_comment_lines():
    text = '# see docs/measurements.md "Draft heads trained\n    # here"; and /* docs/measurements.md "Kernel\n * choices" */'
    assert cited_sections(text) == ["Draft heads trained here", "Kernel choices"]


def test_measurement_citations_name_existing_sections():
    headings = set(re.findall(r"^#+ (.+?)\s*$", (ROOT / "docs" / "measurements.md").read_text(), re.M))
    missing = []
    for d in (PACKAGE, ROOT / "scripts"):
        for path in sorted(d.rglob("*")):
            if path.suffix in _READERS:
                missing += [f"{path.relative_to(ROOT)}: {s!r}" for s in cited_sections(path.read_text())
                            if s not in headings]
    assert not missing, "citations of docs/measurements.md sections that do not exist:\n" + "\n".join(missing)
