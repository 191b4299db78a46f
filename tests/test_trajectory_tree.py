"""Episode trees in the trajectory format (version 3): `parent` links, their JSON, walks and stats."""

import json

import pytest

from turnrl.rollout.tree import branch, common_prefix, link_by_prefix, tree_stats, walk
from turnrl.types import BranchKind, Parent, Segment, SegmentSource, TerminationReason, Trajectory


def _traj(tid: str, prompt: list[int], response: list[int]) -> Trajectory:
    seg = Segment(SegmentSource.MODEL, list(response), [1] * len(response), [-0.5] * len(response), 1, 0)
    traj = Trajectory(id=tid, group_id="g", sample_index=0, prompt_ids=list(prompt), segments=[seg], num_turns=1)
    traj.finish(TerminationReason.ENV_DONE)
    return traj


def test_parent_round_trips_and_version_2_rows_read_as_flat():
    root, fork = _traj("e", [1, 2, 3], [4, 5]), _traj("e.1", [1, 2, 3, 4], [9])
    assert branch(fork, root, BranchKind.FORK) == Parent("e", 4, BranchKind.FORK)
    assert (root.episode_id, fork.episode_id) == ("e", "e")
    row = json.loads(json.dumps(fork.to_json()))
    assert row["format_version"] == 3 and row["parent"] == {"id": "e", "at": 4, "kind": "fork"}
    again = Trajectory.from_json(row)
    again.validate()
    assert again.parent == fork.parent and again.to_json() == row
    v2 = {**row, "format_version": 2}
    del v2["parent"]
    assert Trajectory.from_json(v2).parent is None
    assert json.loads(json.dumps(root.to_json()))["parent"] is None


@pytest.mark.parametrize("parent, field", [
    ({"id": "e", "at": -1, "kind": "fork"}, "parent.at"),
    ({"id": "e", "at": 2, "kind": "merge"}, "parent.kind"),
    ("e", "parent must be null"),
])
def test_a_bad_parent_names_its_field(parent, field):
    row = {**_traj("e.1", [1], [2]).to_json(), "parent": parent}
    with pytest.raises(ValueError, match=field):
        Trajectory.from_json(row)


def test_validate_refuses_a_parent_link_longer_than_the_stream():
    traj = _traj("e.1", [1, 2], [3])
    traj.parent = Parent("e", 4, BranchKind.FORK)
    with pytest.raises(ValueError, match="parent"):
        traj.validate()


def test_a_branch_without_a_shared_token_is_a_new_context():
    root, sub = _traj("e", [1, 2], [3]), _traj("e.1", [7, 8], [9])
    assert branch(sub, root, BranchKind.SUBAGENT).at is None


def test_link_by_prefix_picks_the_longest_shared_prefix_and_walk_draws_the_tree():
    a = _traj("a", [1, 2, 3], [4, 5, 6])
    b = _traj("b", [1, 2, 3, 4], [7])          # forks a after 4 tokens
    c = _traj("c", [1, 2, 3, 4, 7], [8])       # forks b after 5 (a shares only 4)
    d = _traj("d", [1, 9], [9])                # shares 1 token with each: the latest of equals
    link_by_prefix([a, b, c, d], BranchKind.SPLIT)
    assert a.parent is None
    assert (b.parent.id, b.parent.at, c.parent.id, c.parent.at) == ("a", 4, "b", 5)
    assert (d.parent.id, d.parent.at) == ("c", 1)
    assert [(depth, t.id) for depth, t in walk([a, b, c, d])] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert {t.episode_id for t in (a, b, c, d)} == {"a"}
    assert tree_stats([a, b, c, d, _traj("x", [1], [2])]) == {"branches_per_episode": 2.5,
                                                               "compactions_per_episode": 0.0}


def test_walk_survives_a_parent_cycle():
    a, b = _traj("a", [1], [2]), _traj("b", [1], [2])
    a.parent, b.parent = Parent("b", 1, BranchKind.FORK), Parent("a", 1, BranchKind.FORK)
    assert sorted(t.id for _, t in walk([a, b])) == ["a", "b"]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1], [1, 2]) == 1 and common_prefix([], [1]) == 0
