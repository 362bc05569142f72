#!/usr/bin/env python3
"""Import cycles between the files of each crate (what CI refuses).

Every path a file names — `use` statements and paths written inline (`super::video::X`) —
that resolves to another file of the same crate is an edge; a cycle of edges is an error.
A module and its own ancestors (a child using what its parent declares) do not count:
that is how Rust modules are built, not a dependency between peers.

Usage: python3 scripts/check_import_cycles.py [crate_dir ...]   (default: every crate)
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES = ["ares-core", "ares-cpu", "ares-cuda", "ares-model", "ares-runner", "ares-py", "benches"]
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE = re.compile(r"\buse\s+([^;]+);", re.S)


def module_of(src: Path, file: Path) -> tuple:
    rel = file.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def expand_use(tree: str) -> list:
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = re.sub(r"\s+", "", tree)
    i = tree.find("{")
    if i < 0:
        return [tree]
    prefix, body = tree[:i], tree[i + 1 : tree.rfind("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    if cur:
        items.append(cur)
    return [p for item in items for p in expand_use(prefix + item)]


def crate_edges(crate: Path) -> dict:
    src = crate / "src"
    files = {module_of(src, f): f for f in src.rglob("*.rs")}
    edges = {m: set() for m in files}
    for mod, file in files.items():
        text = strip_comments(file.read_text())
        paths = [m.group(0) for m in PATH.finditer(text)]
        for u in USE.finditer(text):
            paths += [p for p in expand_use(u.group(1)) if not p.startswith(("crate", "super", "self"))]
        for path in paths:
            parts = [p for p in path.split("::") if p]
            if parts[0] == "crate":
                target, rest = (), parts[1:]
            elif parts[0] in ("super", "self"):
                target = mod
                while parts and parts[0] in ("super", "self"):
                    if parts[0] == "super":
                        target = target[:-1]
                    parts = parts[1:]
                rest = parts
            else:  # a `use name::...` relative to this module: a child module
                target, rest = mod, parts
            # the longest prefix naming a file
            best = None
            for k in range(len(rest), -1, -1):
                cand = target + tuple(rest[:k])
                if cand in files:
                    best = cand
                    break
            if best is None or best == mod:
                continue
            # a module and its ancestors do not count
            if best == mod[: len(best)] or mod == best[: len(mod)]:
                continue
            edges[mod].add(best)
    return edges


def cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    crates = [Path(a) for a in sys.argv[1:]] or [ROOT / c for c in CRATES]
    bad = 0
    for crate in crates:
        for comp in cycles(crate_edges(crate)):
            bad += 1
            names = ", ".join("::".join(m) or "(root)" for m in comp)
            print(f"{crate.name}: import cycle between {names}")
    if bad:
        return 1
    print(f"no import cycles in {len(crates)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
