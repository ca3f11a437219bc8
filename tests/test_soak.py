"""scripts/soak.py's verdict: a soak that killed less than it planned has tested less, and fails."""

from script_loader import load_script

soak = load_script("soak")


def test_a_soak_fails_unless_every_planned_kill_was_made_and_recovered():
    killer = soak.Killer(engine_kills=2, reward_kills=1, seed=0)
    history = [{"step": s, "engine/restarts": 0.0} for s in (1, 2, 3)]
    # What the soak did when it waited for a status line cross-tree batching no longer shows:
    # no kill at all, every step logged, the resume fine.
    assert soak.failures(3, history, {1, 2, 3}, killer, resumed=True) == [
        "0 of 2 planned engine kills were made: the soak tested less",
        "0 of 1 planned reward kills were made: the soak tested less",
    ]
    killer.done = {"engine": 2, "reward": 1}
    assert soak.failures(3, history, {1, 2, 3}, killer, resumed=True) == ["2 engine kills but 0 restarts"]
    history[1]["engine/restarts"] = history[2]["engine/restarts"] = 1.0
    assert soak.failures(3, history, {1, 2, 3}, killer, resumed=True) == []
    assert soak.failures(3, history[:2], {1, 2}, killer, resumed=False) == [
        "the run stopped after 2 of 3 steps", "steps without a metrics record: [3]", "2 engine kills but 1 restarts",
        "the final checkpoint did not resume",
    ]
