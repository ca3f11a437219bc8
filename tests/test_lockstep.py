"""Ranks in lockstep: the merged schedule holds every rank's walk, and its idle backwards
always have an idle forward's graph to run (arbor.train.lockstep)."""

import random

import pytest

from arbor.train.lockstep import merge_schedules


def random_walk(rng: random.Random, depth: int = 0) -> str:
    """A depth-first walk's calls on a random tree: F, the children's walks, B."""
    children = rng.randint(0, 3) if depth < 4 else 0
    return "F" + "".join(random_walk(rng, depth + 1) for _ in range(children)) + "B"


def is_subsequence(part: str, whole: str) -> bool:
    it = iter(whole)
    return all(c in it for c in part)


def test_merges_by_hand():
    # One rank's leaf under its root, the other's two leaves: the second rank's F comes first.
    assert merge_schedules(["FFBB", "FFBFBB"]) == "FFBFBB"
    assert merge_schedules(["FB", "FFBB"]) == "FFBB"
    assert merge_schedules(["FFBB", "FBFB"]) == "FFBFB"  # rank 0 idles in slot 4 (F), rank 1 in 2 (F)
    assert merge_schedules(["", "FB"]) == "FB"  # an idle pass: every slot idle
    assert merge_schedules(["FFF", "F"]) == "FFF"  # forward-only walks (π_old, the KL reference)
    assert merge_schedules([]) == ""


@pytest.mark.parametrize("seed", range(50))
def test_every_rank_fits_the_schedule_with_graphs_for_its_idle_backwards(seed):
    rng = random.Random(seed)
    walks = ["".join(random_walk(rng) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 4))]
    schedule = merge_schedules(walks)
    for walk in walks:
        assert is_subsequence(walk, schedule), (walk, schedule)
        # Play this rank along the schedule: a slot its walk does not take is idle, and an idle
        # backward needs an earlier idle forward whose graph it has not used yet.
        at, idle_graphs = 0, 0
        for slot in schedule:
            if at < len(walk) and walk[at] == slot:
                at += 1
            elif slot == "F":
                idle_graphs += 1
            else:
                assert idle_graphs > 0, (walk, schedule)
                idle_graphs -= 1
        assert at == len(walk)
    assert len(schedule) <= sum(map(len, walks))
