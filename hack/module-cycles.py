#!/usr/bin/env python3
"""Fails when modules of one crate import each other in a cycle (docs/architecture.md, "1. The parts").

Reads a crate's `src/` as text: every `use` tree and every `crate::`/`super::`/`self::` path,
with `pub use` re-exports followed to the module that defines the item. An import of an
ancestor module (a child using its parent's shared types) is not an edge: Rust's module tree
already nests them. Test modules (`#[cfg(test)] mod tests`, `tests.rs`) are left out.

Usage: hack/module-cycles.py CRATE_SRC_DIR... ; prints each cycle and exits 1 if any.
"""
import collections
import os
import re
import sys


def modules(root):
    mods = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rs"):
                path = os.path.join(dirpath, f)
                parts = os.path.relpath(path, root)[:-3].split("/")
                if parts[-1] in ("mod", "lib", "main"):
                    parts = parts[:-1]
                mods["::".join(parts)] = path
    return mods


def source(path):
    text = open(path, encoding="utf-8").read()
    if os.path.basename(path) == "tests.rs":
        return ""
    for marker in ("#[cfg(test)]\nmod tests", "#[cfg(test)]\npub(crate) mod tests"):
        i = text.find(marker)
        if i >= 0:
            text = text[:i]
    return re.sub(r"//[^\n]*", "", text)


def flatten(tree, prefix=""):
    """`a::{b, c::{d, self}}` -> ["a::b", "a::c::d", "a::c"]."""
    tree = tree.strip()
    i = tree.find("{")
    if i < 0:
        t = re.sub(r"\s+as\s+\w+$", "", tree).strip()
        return [prefix + t] if t else []
    head, body = tree[:i], tree[i + 1 : tree.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = []
    for p in (p.strip() for p in parts):
        if p == "self":
            out.append((prefix + head).rstrip(":"))
        elif p:
            out += flatten(p, prefix + head)
    return out


def cycles(root):
    mods = modules(root)
    src = {m: source(p) for m, p in mods.items()}
    items = collections.defaultdict(set)
    item_re = r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:async\s+)?(?:fn|struct|enum|trait|type|const|static|mod)\s+(\w+)"
    for m, s in src.items():
        items[m].update(re.findall(item_re, s, re.M))

    def absolute(m, path):
        segs, here = path.split("::"), (m.split("::") if m else [])
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] == "self":
            return here + segs[1:]
        if segs[0] == "super":
            k = 0
            while segs and segs[0] == "super":
                segs, k = segs[1:], k + 1
            return here[: len(here) - k] + segs
        if "::".join(here + segs[:1]) in mods:
            return here + segs
        return None

    reexports = collections.defaultdict(lambda: collections.defaultdict(list))
    paths = {}
    for m, s in src.items():
        found = []
        for vis, tree in re.findall(r"(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", s):
            for path in flatten(tree):
                segs = absolute(m, path)
                if segs is None:
                    continue
                found.append(segs)
                name = re.sub(r".*\s+as\s+", "", path.split("::")[-1])
                if vis and name != "*":
                    reexports[m][name].append(segs)
        for path in re.findall(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+)", s):
            segs = absolute(m, path)
            if segs:
                found.append(segs)
        paths[m] = found

    def resolve(segs, depth=0):
        for i in range(len(segs), -1, -1):
            m = "::".join(segs[:i])
            if m in mods:
                rest = segs[i:]
                if rest and rest[0] not in items[m] and depth < 5:
                    for target in reexports[m].get(rest[0], []):
                        r = resolve(target, depth + 1)
                        if r is not None:
                            return r
                return m
        return None

    edges = collections.defaultdict(set)
    for m, found in paths.items():
        for segs in found:
            t = resolve(segs)
            if t is None or t == m or (m.startswith(t + "::") if t else True):
                continue
            edges[m].add(t)

    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return [(c, {a: sorted(t for t in edges[a] if t in c) for a in c}) for c in out]


def main(roots):
    failed = False
    for root in roots:
        for comp, inner in cycles(root):
            failed = True
            print(f"{root}: modules that import each other: {', '.join(comp)}", file=sys.stderr)
            for a in comp:
                print(f"    {a} -> {', '.join(inner[a])}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["src"]))
