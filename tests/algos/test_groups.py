"""Which groups dynamic sampling keeps (pipeline/algos/groups.py), by hand."""
from __future__ import annotations

import pytest

from pipeline.algos.groups import choose_groups, flat_group_indices

pytestmark = pytest.mark.unit


def test_flat_groups_are_those_whose_rewards_are_all_equal():
    assert flat_group_indices([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], 2) == [0, 2]
    assert flat_group_indices([0.1, 0.1, 0.1], 3) == [0]
    assert flat_group_indices([], 2) == []
    # One sample a group: nothing to compare it with, so every group is flat.
    assert flat_group_indices([0.0, 1.0], 1) == [0, 1]
    with pytest.raises(ValueError, match="3 rewards do not split into groups of 2"):
        flat_group_indices([1.0, 0.0, 1.0], 2)


def test_the_first_informative_groups_are_kept_in_launch_order():
    # Batch a: groups [1,0] (informative), [1,1] (flat); batch b: [0,1], [0,0], [1,0].
    choice = choose_groups([("a", [1.0, 0.0, 1.0, 1.0]), ("b", [0.0, 1.0, 0.0, 0.0, 1.0, 0.0])], 2, wanted=2)
    assert choice.keep == {"a": (0,), "b": (0,)}
    assert choice.flat == {"a": (1,), "b": (1,)}
    assert choice.surplus == {"a": (), "b": (2,)}
    assert choice.informative == 2


def test_every_group_is_kept_flat_or_surplus_exactly_once():
    batches = [("a", [0.0, 0.0, 0.5, 0.0]), ("b", [1.0, 1.0]), ("c", [0.2, 0.3, 0.3, 0.3])]
    choice = choose_groups(batches, 2, wanted=10)
    for batch_id, rewards in batches:
        groups = [*choice.keep[batch_id], *choice.flat[batch_id], *choice.surplus[batch_id]]
        assert sorted(groups) == list(range(len(rewards) // 2))
    assert choice.informative == 2 and choice.surplus == {"a": (), "b": (), "c": ()}


def test_all_flat_keeps_nothing_and_wanting_none_makes_all_surplus():
    assert choose_groups([("a", [1.0, 1.0, 0.0, 0.0])], 2, wanted=4).informative == 0
    choice = choose_groups([("a", [1.0, 0.0])], 2, wanted=0)
    assert choice.keep == {"a": ()} and choice.surplus == {"a": (0,)}
