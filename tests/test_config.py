"""Config loading: types, unknown keys, combinations, overrides, round-trip."""

from pathlib import Path

import pytest

from arbor.config import Config, dump_config
from arbor.config_load import load_config
from arbor.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_round_trip(tmp_path):
    cfg = load_config(None)
    again = load_config(write(tmp_path, dump_config(cfg)))
    assert again == cfg


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_load_and_round_trip(tmp_path, name):
    cfg = load_config(REPO / "configs" / name)
    assert load_config(write(tmp_path, dump_config(cfg))) == cfg


def test_math_config_is_the_paper_setting():
    cfg = load_config(REPO / "configs" / "math.yaml")
    assert (cfg.rollout.max_depth, cfg.rollout.segment_tokens, cfg.rollout.width) == (14, 512, 16)
    assert cfg.engine.kind == "sglang" and cfg.learner.zero_stage == 3
    assert cfg.rollout.max_response_tokens == 14 * 512


def test_typo_names_key_file_and_line(tmp_path):
    path = write(tmp_path, "run:\n  steps: 3\nloss:\n  clip_low: 0.2\n  clip_hihg: 0.3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "clip_hihg" in msg and f"{path}:5" in msg and "clip_high" in msg  # suggestion


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trainer'"):
        load_config(write(tmp_path, "trainer:\n  lr: 1\n"))


@pytest.mark.parametrize(
    "override, key",
    [
        ("loss.clip_high=abc", "loss.clip_high must be a number"),
        ("run.steps=2.5", "run.steps must be an integer"),
        ("learner.zero_stage=true", "learner.zero_stage must be an integer"),
        ("run.resume=1", "run.resume must be true or false"),
        ("rollout.mode=beam", "rollout.mode must be one of 'tree', 'independent'"),
        ("optim.betas=0.9", "optim.betas must be a list"),
        ("reward.functions=[{fn: a:b, weight: x}]", "reward.functions[0].weight must be a number"),
        ("model=3", "model must be a mapping"),
    ],
)
def test_wrong_types_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert key in str(err.value)
    assert f"override {override!r}" in str(err.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout.branch=32"], "rollout.branch"),
        (["rollout.width=0"], "rollout.width"),
        (["rollout.top_p=0"], "rollout.top_p"),
        (["rollout.root_fork=0"], "rollout.root_fork"),
        (["rollout.root_fork=[3, 2]"], "rollout.root_fork"),
        (["loss.clip_low=1.5"], "loss.clip_low"),
        (["engine.kind=external"], "engine.urls"),
        (["engine.urls=[http://x:1]"], "engine.urls"),
        (["learner.backend=torch", "learner.num_ranks=2"], "learner.num_ranks"),
        (["learner.zero_stage=4"], "learner.zero_stage"),
        (["learner.pack_tokens=100"], "learner.pack_tokens"),
        (["learner.device=cpu", "engine.kind=sglang", "engine.deterministic=true"], "engine.deterministic"),
        (["run.eval_every=5"], "run.eval_every"),
        (["learner.device=cpu", "learner.attention=flex"], "learner.attention"),
        (["reward.functions=[]"], "reward.functions"),
        (["reward.functions=[{fn: nocolon}]"], "reward.functions[0].fn"),
        (["algorithm.minibatches=64", "data.prompts_per_step=8"], "algorithm.minibatches"),
    ],
)
def test_invalid_combinations_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value)


def test_overrides_apply_and_widen_ints():
    cfg = load_config(
        None,
        ["loss.clip_high=1", "engine.kind=external", "engine.urls=[http://a:1, http://b:2]",
         "ray.address=auto", "model.ref_path=null", "data.eval_path=x.jsonl", "run.eval_every=3"],
    )
    assert cfg.loss.clip_high == 1.0 and isinstance(cfg.loss.clip_high, float)
    assert cfg.engine.urls == ["http://a:1", "http://b:2"]
    assert cfg.ray.address == "auto" and cfg.model.ref_path is None


def test_exponent_floats_without_a_dot(tmp_path):
    # YAML 1.1 reads `1e-6` as a string; a learning rate written that way must still work.
    cfg = load_config(write(tmp_path, "optim:\n  lr: 1e-6\n"), ["loss.kl_coef=2E-3"])
    assert cfg.optim.lr == 1e-6 and cfg.loss.kl_coef == 2e-3
    with pytest.raises(ConfigError, match="optim.lr must be a number"):
        load_config(None, ["optim.lr=1e-"])


def test_nested_reward_terms(tmp_path):
    path = write(
        tmp_path,
        "reward:\n  functions:\n    - fn: rewards/math.py:boxed_accuracy\n      weight: 1\n"
        "    - fn: rewards/math.py:boxed_format\n      weight: 0.1\n",
    )
    cfg = load_config(path)
    assert [t.weight for t in cfg.reward.functions] == [1.0, 0.1]
    assert cfg.source == str(path.resolve())


@pytest.mark.parametrize("bad", ["loss", "=3", "loss.=3", "loss.clip_high.x=3"])
def test_malformed_overrides(bad):
    with pytest.raises(ConfigError):
        load_config(None, [bad])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "run: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_empty_file_is_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()


def test_validate_a_config_built_in_code_names_the_key():
    from arbor.config_load import validate

    cfg = Config()
    validate(cfg)  # the defaults pass with the default `where`
    cfg.run.keep_checkpoints = 0
    with pytest.raises(ConfigError, match=r"^<config>: run.keep_checkpoints must be ≥ 1, got 0"):
        validate(cfg)
    cfg.run.keep_checkpoints, cfg.reward.max_failure_fraction = 2, 1.5
    with pytest.raises(ConfigError, match=r"^<config>: reward.max_failure_fraction must be in \[0, 1\]"):
        validate(cfg)


def test_cpu_threads_names_the_key_and_sets_each_process_share(tmp_path, monkeypatch):
    from arbor.run.orchestration import cpu_threads

    with pytest.raises(ConfigError, match=r"run.cpu_threads must be ≥ 0 \(0: all cores\), got -1"):
        load_config(write(tmp_path, "run:\n  cpu_threads: -1\n"))
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    cfg = Config()  # one engine, one learner rank and the driver split 8 cores
    assert (cpu_threads(cfg), cpu_threads(cfg, processes=2), cpu_threads(cfg, processes=16)) == (2, 4, 1)
    cfg.engine.num_engines, cfg.learner.num_ranks = 2, 2
    assert cpu_threads(cfg) == 1
    cfg.algorithm.max_staleness = 1  # the same rule asynchronous
    assert cpu_threads(cfg) == 1
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cpu_threads(Config()) == 1  # 2 cores: one thread per process, the fastest measured there
    cfg.run.cpu_threads = 3  # set: every process, however many cores
    assert (cpu_threads(cfg), cpu_threads(cfg, processes=2)) == (3, 3)


def test_max_staleness_refuses_what_cannot_overlap():
    """Asynchronous runs: the error names both keys of each impossible combination."""
    assert load_config(None, []).algorithm.max_staleness == 0  # on-policy by default
    assert load_config(None, ["algorithm.max_staleness=2", "engine.partial_rollouts=true"]).engine.partial_rollouts
    # Colocated engines keep their memory in asynchronous runs (context.engines_released).
    assert load_config(None, ["algorithm.max_staleness=1", "ray.colocate=true"]).ray.colocate
    with pytest.raises(ConfigError, match=r"algorithm.max_staleness must be 0 with algorithm.ppo_epochs > 1 \(got 2\)"):
        load_config(None, ["algorithm.max_staleness=1", "algorithm.ppo_epochs=2"])
    with pytest.raises(ConfigError, match=r"algorithm.max_staleness must be ≥ 0 \(0: on-policy\), got -1"):
        load_config(None, ["algorithm.max_staleness=-1"])
    with pytest.raises(ConfigError, match=r"engine.partial_rollouts needs algorithm.max_staleness ≥ 1"):
        load_config(None, ["engine.partial_rollouts=true"])
    with pytest.raises(ConfigError, match=r"loss.behaviour_cap must be > 0, got 0"):
        load_config(None, ["loss.behaviour_cap=0"])
