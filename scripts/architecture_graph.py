"""Draw the package graph from the code: which layer imports which, read by grimp (import-linter's graph, imports
inside functions included) and laid out in the layers .importlinter declares.

    python scripts/architecture_graph.py            # writes docs/architecture.svg and docs/architecture.mmd
    python scripts/architecture_graph.py --check    # exit 1 if the checked-in files differ from the code's graph

Written by hand rather than with pydeps/graphviz: those need the `dot` binary (not on CI), and a layered picture
is a few rectangles and curves once the layers are known.
"""

from __future__ import annotations

import argparse
import configparser
import html
import sys
from collections import Counter
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BOX_W, BOX_H, ROW_H, WIDTH, TOP = 170, 46, 96, 900, 20


def layers() -> list[list[str]]:
    """The layers contract of .importlinter, top first; siblings of a layer in one list."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    text = cfg["importlinter:contract:layers"]["layers"]
    return [[p.strip() for p in line.split("|")] for line in text.strip().splitlines() if line.strip()]


def package_of(module: str, packages: list[str]) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def package_edges(packages: list[str]) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """(imports between packages, modules per package)."""
    # No cache: a stale .grimp_cache once hid new imports (the picture passed here and failed in a fresh clone).
    graph = grimp.build_graph("optimizer", "passes", exclude_type_checking_imports=True, cache_dir=None)
    edges: Counter[tuple[str, str]] = Counter()
    sizes: Counter[str] = Counter()
    for module in graph.modules:
        src = package_of(module, packages)
        if src is None:
            continue
        sizes[src] += 1
        for imported in graph.find_modules_directly_imported_by(module):
            dst = package_of(imported, packages)
            if dst is not None and dst != src:
                edges[(src, dst)] += 1
    return edges, sizes


def svg(rows: list[list[str]], edges: Counter[tuple[str, str]], sizes: Counter[str]) -> str:
    pos: dict[str, tuple[float, float]] = {}
    for r, row in enumerate(rows):
        gap = WIDTH / (len(row) + 1)
        for i, pkg in enumerate(row):
            pos[pkg] = (gap * (i + 1), TOP + r * ROW_H)
    height = TOP * 2 + (len(rows) - 1) * ROW_H + BOX_H + 44
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' font-family='DejaVu Sans,"
        "sans-serif' font-size='13'>",
        "<defs><marker id='a' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='9' markerHeight='9' "
        "markerUnits='userSpaceOnUse' orient='auto'><path d='M0,0L10,5L0,10z' fill='#4a5568'/></marker></defs>",
        "<rect width='100%' height='100%' fill='white'/>",
    ]
    for (src, dst), n in sorted(edges.items()):
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        # An import sideways or upward breaks the layering: red (the contracts make it fail the tests).
        color = "#c53030" if y2 <= y1 else "#718096"
        half = BOX_W / 2 - 12  # ends spread along the box edges, toward the other end, so arrows stay apart
        x1, x2 = x1 + max(-half, min(half, (x2 - x1) * 0.3)), x2 + max(-half, min(half, (x1 - x2) * 0.3))
        sy, ey = (y1 + BOX_H, y2) if y2 > y1 else (y1 + BOX_H / 2, y2 + BOX_H / 2)
        bend = max((ey - sy) * 0.5, 20)
        out.append(
            f"<path d='M{x1:.0f},{sy:.0f} C{x1:.0f},{sy + bend:.0f} {x2:.0f},{ey - bend:.0f} {x2:.0f},{ey:.0f}' "
            f"fill='none' stroke='{color}' stroke-width='{1 + min(n, 40) / 10:.1f}' opacity='0.7' "
            f"marker-end='url(#a)'><title>{html.escape(src)} imports {html.escape(dst)}: {n}</title></path>"
        )
    for pkg, (x, y) in pos.items():
        label = pkg.removeprefix("optimizer.")
        out.append(
            f"<rect x='{x - BOX_W / 2:.0f}' y='{y:.0f}' width='{BOX_W}' height='{BOX_H}' rx='6' fill='#ebf4ff' "
            f"stroke='#2b6cb0'/><text x='{x:.0f}' y='{y + 20:.0f}' text-anchor='middle' font-weight='bold'>"
            f"{html.escape(label)}</text><text x='{x:.0f}' y='{y + 37:.0f}' text-anchor='middle' fill='#4a5568' "
            f"font-size='11'>{sizes[pkg]} modules</text>"
        )
    out.append(
        f"<text x='10' y='{height - 26}' fill='#4a5568' font-size='11'>An arrow: the package imports from the one "
        "it points to (width: how many imports; imports inside functions count).</text>"
        f"<text x='10' y='{height - 10}' fill='#4a5568' font-size='11'>A row may import only the rows below it; "
        "siblings in a row may not import each other. Red marks an import that breaks that.</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def mermaid(rows: list[list[str]], edges: Counter[tuple[str, str]]) -> str:
    ident = {p: p.replace(".", "_") for row in rows for p in row}
    lines = ["flowchart TD"]
    lines += [f"  {ident[p]}[{p.removeprefix('optimizer.')}]" for row in rows for p in row]
    lines += [f"  {ident[s]} -->|{n}| {ident[d]}" for (s, d), n in sorted(edges.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the checked-in files instead")
    args = parser.parse_args()
    rows = layers()
    edges, sizes = package_edges([p for row in rows for p in row])
    files = {DOCS / "architecture.svg": svg(rows, edges, sizes), DOCS / "architecture.mmd": mermaid(rows, edges)}
    if args.check:
        stale = [str(p.relative_to(ROOT)) for p, text in files.items() if not p.is_file() or p.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)} (run python scripts/architecture_graph.py)", file=sys.stderr)
            return 1
        return 0
    DOCS.mkdir(exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
    print(f"{len(sizes)} packages, {sum(edges.values())} imports between them -> docs/architecture.svg, .mmd")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
