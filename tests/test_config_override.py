"""Command-line overrides of lists and nested keys (arbor/config_override.py): the indexed
form works, a wrong guess shows the working syntax, and errors name the override."""

import re
from pathlib import Path

import pytest

from arbor.config import RewardTermConfig
from arbor.config_load import load_config
from arbor.config_override import override_syntax
from arbor.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
FN = "rewards/math.py:boxed_format"


def error_of(overrides: list[str], path: Path | None = QUICKSTART) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return str(err.value)


def suggested(message: str) -> list[str]:
    """The overrides a message suggests (each written inside single quotes)."""
    return re.findall(r"'([^' ]+=[^']*)'", message)


def test_indexed_form_sets_one_key_of_one_item():
    cfg = load_config(QUICKSTART, [f"reward.functions[0].fn={FN}"])
    assert [(t.fn, t.weight) for t in cfg.reward.functions] == [(FN, 1.0)]


def test_whole_list_in_yaml_flow_syntax():
    cfg = load_config(QUICKSTART, [f"reward.functions=[{{fn: {FN}, weight: 0.5}}]"])
    assert cfg.reward.functions == [RewardTermConfig(FN, 0.5)]


def test_index_equal_to_the_length_adds_an_item():
    cfg = load_config(QUICKSTART, [f"reward.functions[1].fn={FN}", "reward.functions[1].weight=0.1"])
    assert [(t.fn, t.weight) for t in cfg.reward.functions] == [
        ("rewards/math.py:boxed_accuracy", 1.0), (FN, 0.1)]
    cfg = load_config(None, ["engine.extra_args[0]=--foo", "engine.extra_args[1]=--bar"])
    assert cfg.engine.extra_args == ["--foo", "--bar"]


def test_a_list_the_file_leaves_out_is_indexed_from_its_default():
    cfg = load_config(None, ["reward.functions[0].weight=2"])  # the default term, reweighted
    assert cfg.reward.functions == [RewardTermConfig(weight=2.0)]
    assert load_config(None, ["optim.betas[1]=0.95"]).optim.betas == [0.9, 0.95]


def test_index_past_the_end_says_the_range():
    message = error_of([f"reward.functions[3].fn={FN}"])
    assert "reward.functions has 1 item(s), so its indices are 0 to 0; [1] adds an item" in message


@pytest.mark.parametrize("guess", [
    f"reward.functions.0.fn={FN}",           # a dotted index
    f"reward.functions={FN}",                 # a string for a list
    f'reward.functions=["{FN}"]',             # a list of strings for a list of mappings
    f"reward.functions.fn={FN}",              # a list addressed as a section
])
def test_wrong_guesses_name_the_override_and_show_syntax_that_works(guess):
    message = error_of([guess])
    assert message.startswith(f"override {guess!r}: "), message
    assert "quickstart.yaml" not in message  # never blamed on a line of the file
    fixes = suggested(message.removeprefix(f"override {guess!r}: "))
    assert fixes and any(f.startswith("reward.functions=[{fn: ") for f in fixes), message
    assert f"'reward.functions=[{{fn: {FN}, weight: 1.0}}]'" in message  # the user's function, in place
    for fix in fixes:  # every suggestion is itself an override that works
        assert load_config(QUICKSTART, [fix]).reward.functions[0].fn == FN


def test_the_dotted_index_is_corrected_with_the_users_value():
    message = error_of([f"reward.functions.0.fn={FN}"])
    assert f"write 'reward.functions[0].fn={FN}'" in message


def test_errors_inside_an_override_name_it_not_the_file(tmp_path):
    bad = "reward.functions=[{fn: rewards/math.py:boxed_accuracy, weight: heavy}]"
    assert error_of([bad]).startswith(f"override {bad!r}: reward.functions[0].weight must be a number")
    bad = "reward.functions[0].wieght=2"
    message = error_of([bad])
    assert message.startswith(f"override {bad!r}: unknown key 'reward.functions[0].wieght'") and "'weight'" in message
    # A key the file sets and no override touched still names its line.
    assert error_of(["reward.functions[0].fn=nocolon"]).startswith("override ")
    copy = tmp_path / "copy.yaml"
    copy.write_text(QUICKSTART.read_text().replace("weight: 1.0", "weight: heavy", 1))
    message = error_of(["loss.clip_low=0.2"], path=copy)
    assert re.match(r".*copy\.yaml:\d+: reward.functions\[0\].weight must be a number", message)


def test_a_later_override_of_the_whole_list_owns_its_items():
    bad = "reward.functions=[{fn: nocolon}]"
    message = error_of([f"reward.functions[0].fn={FN}", bad])
    assert message.startswith(f"override {bad!r}: reward.functions[0].fn must be 'module:attr'")


def test_syntax_examples_for_each_kind_of_key():
    assert override_syntax("reward.functions", list[RewardTermConfig]) == (
        "'reward.functions=[{fn: rewards/math.py:boxed_accuracy, weight: 1.0}]' (the whole list, YAML flow "
        "syntax) or 'reward.functions[0].fn=rewards/math.py:boxed_accuracy' (one key of one item)")
    message = error_of(["optim.betas=0.9"], path=None)
    assert "'optim.betas=[a, b]' (the whole list, YAML flow syntax; [] for none) or 'optim.betas[0]=a'" in message

