"""docs/configuration.md is generated from arbor/config.py: it must match what the generator
writes now, and the generator must refuse a key without a comment."""

import textwrap

import pytest
from script_loader import load_script

import arbor.config

gen = load_script("gen_config_docs")


def test_configuration_page_is_fresh():
    committed = gen.OUTPUT.read_text() if gen.OUTPUT.exists() else ""
    assert committed == gen.generate(), (
        "docs/configuration.md is stale (a config key, type, default or comment changed): "
        f"regenerate it with `{gen.COMMAND}` and commit the result"
    )


def test_every_key_is_listed():
    text = gen.OUTPUT.read_text()
    for section in ("model", "rollout", "engine", "loss", "learner", "run"):
        for name in vars(getattr(arbor.config.Config(), section)):
            assert f"| `{section}.{name}` |" in text, f"{section}.{name} missing from docs/configuration.md"


SOURCE = textwrap.dedent('''
    from dataclasses import dataclass, field
    from typing import Literal

    Mode = Literal["a", "b"]

    @dataclass
    class TermConfig:
        fn: str = "x:y"  # the function
        # its weight
        weight: float = 1.0

    @dataclass
    class PartConfig:
        # how it runs;
        # two lines
        mode: Mode = "a"  # a or b
        size: int = 3
        # the terms
        terms: list[TermConfig] = field(default_factory=lambda: [TermConfig()])

        @property
        def double(self) -> int:
            return 2 * self.size

    @dataclass
    class Config:
        part: PartConfig = field(default_factory=PartConfig)
        source: str | None = None  # not a section
''')


def _build(source):
    namespace: dict = {}
    exec(compile(source, "<schema>", "exec"), namespace)
    return namespace


def test_undocumented_key_is_named():
    ns = _build(SOURCE)
    config = ns["Config"]()
    with pytest.raises(gen.UndocumentedKeys, match=r": part\.size$"):
        gen.collect_keys(SOURCE, config)


def test_meaning_type_and_default_are_read_from_the_source():
    source = SOURCE.replace("size: int = 3", "size: int = 3  # items")
    config = _build(source)["Config"]()
    sections, keys = gen.collect_keys(source, config)
    assert [name for name, _ in sections] == ["part"]
    by_name = {k.name: k for k in keys}
    assert list(by_name) == ["part.mode", "part.size", "part.terms", "part.terms[i].fn",
                            "part.terms[i].weight"]
    assert by_name["part.mode"].meaning == "a or b. how it runs; two lines."
    assert by_name["part.mode"].type == "Literal['a', 'b']"
    assert by_name["part.terms[i].weight"].meaning == "its weight."
    assert gen.show_default(by_name["part.terms"].default) == "[{fn: 'x:y', weight: 1.0}]"
    assert gen.show_default(None) == "null"


def test_override_examples_on_the_page_work():
    """Each override the page shows loads (as the shell passes it: outer quotes removed) and
    sets what its row says."""
    import shlex

    from arbor.config_load import load_config

    text = gen.OUTPUT.read_text()
    loaded = {}
    for example, _ in gen.OVERRIDE_EXAMPLES:
        assert f"| `{example}` |" in text
        (override,) = shlex.split(example)
        loaded[override.partition("=")[0]] = load_config(None, [override])
    assert loaded["run.steps"].run.steps == 10
    assert loaded["engine.extra_args"].engine.extra_args == ["--context-length", "4096"]
    assert [(t.fn, t.weight) for t in loaded["reward.functions"].reward.functions] == [
        ("rewards/math.py:boxed_format", 0.5)]
    assert [t.fn for t in loaded["reward.functions[0].fn"].reward.functions] == ["rewards/math.py:boxed_format"]
    assert loaded["rollout.agent_args.max_tool_calls"].rollout.agent_args == {"max_tool_calls": 2}
