"""Fresh names for what a pass adds to a graph (nodes, tensors, initializers)."""

from __future__ import annotations


def unique_name(base: str, taken: set[str]) -> str:
    """The first of base, base_1, base_2, ... not in taken; added to taken, so the next call makes another."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name
