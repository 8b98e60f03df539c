"""unique_name: the one way a pass names what it adds to a graph."""

from __future__ import annotations

from optimizer.core.names import unique_name


def test_unique_name_keeps_a_free_base_and_numbers_a_taken_one() -> None:
    taken = {"a", "a_1", "b"}
    assert unique_name("c", taken) == "c"
    assert unique_name("a", taken) == "a_2"
    assert unique_name("a", taken) == "a_3"  # each call reserves its name
    assert taken == {"a", "a_1", "a_2", "a_3", "b", "c"}
