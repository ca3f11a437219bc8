"""Environments: the protocol checked once at load, errors naming the keys, the agent adapter."""

from __future__ import annotations

import pytest

from arbor import Step
from arbor.config import RewardConfig, RolloutConfig
from arbor.config_load import load_config
from arbor.errors import ConfigError
from arbor.rollout.environments import AgentEnv, load_env, require_reward, rollout_env

ENVS = '''
import copy
from arbor import Env, Step

class Counter:                      # no base class: the protocol is structural
    fork = "copy"
    closed = []
    def __init__(self, start=0):
        self.n = start
    def reset(self, problem, seed):
        return [{"role": "user", "content": problem["prompt"]}]
    def step(self, history):
        self.n += 1
        return Step([{"role": "tool", "content": str(self.n)}], done=self.n >= 3)
    def reward(self):
        return float(self.n)
    def copy(self):
        return copy.deepcopy(self)
    def close(self):
        Counter.closed.append(self.n)

class Defaults(Env):                # subclassing inherits fork="replay", reward None, close
    def reset(self, problem, seed):
        return []
    def step(self, history):
        return Step([])

class AsyncClose(Env):
    closed = 0
    def reset(self, problem, seed):
        return []
    def step(self, history):
        return Step([])
    async def close(self):
        AsyncClose.closed += 1

def make_counter(start=5):          # a factory works like a class
    return Counter(start)

class NoStep:
    def reset(self, problem, seed):
        return []

class BadFork(Defaults):
    fork = "snapshot"

class CopyWithoutCopy:
    fork = "copy"
    def reset(self, problem, seed):
        return []
    def step(self, history):
        return Step([])

class NeedsArgs(Defaults):
    def __init__(self, size):
        self.size = size

instance = Counter()
'''


@pytest.fixture()
def envs(tmp_path):
    (tmp_path / "envs.py").write_text(ENVS)
    return [str(tmp_path)]


def test_a_class_or_a_factory_loads_checked_and_the_probe_is_closed(envs):
    source = load_env("envs.py:Counter", search_dirs=envs, kwargs={"start": 1})
    module = type(source.make()).__module__
    import sys

    assert sys.modules[module].Counter.closed == [1]  # the start-up probe was built with env_args, then closed
    env = source.make()
    assert env.n == 1 and source.gives_reward and not source.is_agent and source.key == "rollout.env"
    assert load_env("envs.py:make_counter", search_dirs=envs).make().n == 5
    defaults = load_env("envs.py:Defaults", search_dirs=envs)
    instance = defaults.make()
    assert instance.fork == "replay" and instance.reward() is None and instance.close() is None
    assert not defaults.gives_reward and isinstance(instance.copy(), type(instance))
    load_env("envs.py:AsyncClose", search_dirs=envs)
    assert sys.modules[module].AsyncClose.closed == 1  # an async close is awaited too


@pytest.mark.parametrize(("spec", "kwargs", "message"), [
    ("envs.py:NoStep", None, "rollout.env: 'envs.py:NoStep' builds a NoStep, which is not an environment: it has no step method"),
    ("envs.py:BadFork", None, "rollout.env: BadFork.fork must be one of copy, replay, none, got 'snapshot'"),
    ("envs.py:CopyWithoutCopy", None, "rollout.env: CopyWithoutCopy.fork is 'copy' but it has no copy() method"),
    ("envs.py:NeedsArgs", None, "rollout.env: 'envs.py:NeedsArgs' cannot be built without arguments"),
    ("envs.py:Counter", {"size": 2}, "rollout.env: 'envs.py:Counter' cannot be built with rollout.env_args {'size': 2}"),
    ("envs.py:instance", None, "rollout.env: 'envs.py:instance' must name a class or a factory"),
    ("envs.py:Nothing", None, "rollout.env: module 'envs.py' has no attribute 'Nothing'"),
])
def test_what_is_not_an_environment_fails_naming_the_key(envs, spec, kwargs, message):
    with pytest.raises(ConfigError) as info:
        load_env(spec, search_dirs=envs, kwargs=kwargs)
    assert message in str(info.value)


def test_a_stateless_agent_is_an_environment_that_never_needs_a_real_fork():
    class Echo:
        def start(self, problem):
            return [{"role": "user", "content": problem["prompt"]}]

        def step(self, problem, history):
            return None if len(history) > 2 else [{"role": "tool", "content": problem["prompt"]}]

    env = AgentEnv(Echo())
    assert env.reset({"prompt": "q"}, seed=3) == [{"role": "user", "content": "q"}]
    twin = env.copy()
    assert twin is not env and twin.agent is env.agent and env.fork == "copy"
    assert twin.step([{}, {}]) == Step([{"role": "tool", "content": "q"}], done=False)
    assert twin.step([{}, {}, {}]) == Step([], done=True) and twin.reward() is None


def test_env_and_agent_together_and_a_missing_reward_are_config_errors(envs):
    with pytest.raises(ConfigError, match=r"rollout.env and rollout.agent are both set"):
        load_config(None, ["rollout.env=envs.py:Counter", "rollout.agent=agents/single_turn.py:SingleTurn"])
    with pytest.raises(ConfigError, match=r"rollout.env and rollout.agent are both set"):
        rollout_env(RolloutConfig(env="envs.py:Counter", agent="agents/single_turn.py:SingleTurn"), envs)
    with pytest.raises(ConfigError, match=r"reward.functions must name at least one reward function \(it may be "
                                          r"empty only when rollout.env or a program gives the reward\)"):
        load_config(None, ["reward.functions=[]"])
    load_config(None, ["reward.functions=[]", "rollout.program=agents/openai_tool.py:program"])
    cfg = load_config(None, ["reward.functions=[]", "rollout.env=envs.py:Defaults"])
    with pytest.raises(ConfigError, match=r"reward.functions is empty but rollout.env 'envs.py:Defaults' defines "
                                          r"no reward\(\)"):
        require_reward(rollout_env(cfg.rollout, envs), cfg.reward)
    require_reward(rollout_env(RolloutConfig(env="envs.py:Counter"), envs), RewardConfig(functions=[]))
    with pytest.raises(ConfigError, match="reward.env_weight is 0"):
        require_reward(rollout_env(RolloutConfig(env="envs.py:Counter"), envs), RewardConfig(functions=[], env_weight=0))
    with pytest.raises(ConfigError, match="rollout.env_args needs rollout.env"):
        load_config(None, ["rollout.env_args={a: 1}"])
    with pytest.raises(ConfigError, match="rollout.max_live_envs must be ≥ 0"):
        load_config(None, ["rollout.max_live_envs=-1"])
    # EPTree forks multi-turn episodes (at tokens of model turns): an agent or environment is allowed.
    assert load_config(None, ["rollout.fork_at=entropy", "rollout.agent=agents/single_turn.py:SingleTurn"])
    assert load_config(None, ["rollout.fork_at=entropy", "rollout.env=envs.py:Counter"]).rollout.env


AGENTS = '''
class Echo:
    def __init__(self, prefix="> "):
        self.prefix = prefix
    def start(self, problem):
        return [{"role": "user", "content": problem["prompt"]}]
    def step(self, problem, history):
        return [{"role": "tool", "content": self.prefix + history[-1]["content"]}]
'''


def test_an_agent_or_an_environment_becomes_the_run_s_source(envs):
    # File specs (envs.py:...): the repo's own envs/ folder would shadow a module named envs.
    from pathlib import Path

    (Path(envs[0]) / "agents_mod.py").write_text(AGENTS)
    assert rollout_env(RolloutConfig(), envs) is None  # single-turn rollouts
    source = rollout_env(RolloutConfig(agent="agents_mod.py:Echo", agent_args={"prefix": "# "}), envs)
    assert (source.key, source.spec, source.gives_reward, source.is_agent) == ("rollout.agent", "agents_mod.py:Echo",
                                                                               False, True)
    env = source.make()
    assert isinstance(env, AgentEnv) and env.agent is source.agent and source.agent.prefix == "# "
    source = rollout_env(RolloutConfig(env="envs.py:make_counter", env_args={"start": 2}), envs)
    assert (source.key, source.spec, source.gives_reward, source.is_agent, source.make().n) == (
        "rollout.env", "envs.py:make_counter", True, False, 2)
    with pytest.raises(ConfigError, match=r"^rollout\.env and rollout\.agent are both set: an environment replaces "
                                          r"the agent \(a stateless agent is an environment\); keep one$"):
        rollout_env(RolloutConfig(env="envs.py:Counter", agent="agents_mod.py:Echo"), envs)
    with pytest.raises(ConfigError, match=r"^rollout\.env: 'envs.py:instance' must name a class or a factory \(one "
                                          r"instance per episode\), got a Counter$"):
        rollout_env(RolloutConfig(env="envs.py:instance"), envs)


def test_the_protocol_s_errors_say_exactly_what_is_wrong():
    from arbor import Env
    from arbor.rollout.environments import check_env, fork_mode, gives_reward

    class Empty:
        pass

    with pytest.raises(ConfigError) as e:
        check_env(Empty(), "rollout.env", "m:Empty")
    assert str(e.value) == ("rollout.env: 'm:Empty' builds a Empty, which is not an environment: it has no reset "
                            "and no step method (an environment needs reset(problem, seed) -> messages and "
                            "step(history) -> Step)")
    for name in ("reward", "copy", "close"):
        bad = type("Bad", (Env,), {"reset": lambda self, p, s: [], "step": lambda self, h: Step([]), name: 3})
        with pytest.raises(ConfigError) as e:
            check_env(bad(), "rollout.env", "m:Bad")
        assert str(e.value) == f"rollout.env: Bad.{name} must be a method"
    copyless = type("Copyless", (), {"fork": "copy", "reset": lambda self, p, s: [], "step": lambda self, h: Step([])})
    with pytest.raises(ConfigError) as e:
        check_env(copyless(), "rollout.env", "m:Copyless")
    assert str(e.value) == ("rollout.env: Copyless.fork is 'copy' but it has no copy() method (add one, subclass "
                            "arbor.Env for a deepcopy, or fork by 'replay')")
    assert fork_mode(Empty(), "rollout.env") == "replay"  # the default
    assert not gives_reward(Empty()) and not gives_reward(type("Plain", (Env,), {})())

    class Deep(Env):
        def __init__(self):
            self.notes = [[1]]

    original = Deep()
    twin = original.copy()  # Env's copy is a deep copy: nothing shared
    twin.notes[0].append(2)
    assert original.notes == [[1]]


def test_without_reward_functions_the_reward_must_come_from_the_environment(envs):
    messages = {
        None: "reward.functions is empty and no rollout.env gives a reward: name a reward function",
        "defaults": "reward.functions is empty but rollout.env 'envs.py:Defaults' defines no reward() (it gives none): "
                    "name a reward function or give the environment a reward",
    }
    for source, message in ((None, messages[None]), (load_env("envs.py:Defaults", search_dirs=envs), messages["defaults"])):
        with pytest.raises(ConfigError) as e:
            require_reward(source, RewardConfig(functions=[]))
        assert str(e.value) == message
    counter = load_env("envs.py:Counter", search_dirs=envs)
    with pytest.raises(ConfigError) as e:
        require_reward(counter, RewardConfig(functions=[], env_weight=0.0))
    assert str(e.value) == "reward.functions is empty and reward.env_weight is 0: every reward would be 0"
    require_reward(counter, RewardConfig(functions=[]))  # the environment's reward will do
