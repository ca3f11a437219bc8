"""reasoning-gym's own scorers as arbor reward functions (``pip install 'arbor[reasoning-gym]'``).

    data:
      train_path: reasoning_gym:chain_sum?size=500&seed=1     # arbor.dataset_sources
      system_prompt: "... Give the answer as <answer>answer here</answer>."
    reward:
      functions:
        - fn: arbor:reasoning_gym_score

Each problem of a ``reasoning_gym:NAME`` set remembers the item it came from; the reward
regenerates that item (metadata included: many scorers need it, e.g. every valid
solution of a puzzle) and returns the dataset's ``score_answer(answer, item)``, 0 to 1.
:func:`reasoning_gym_score` reads the answer the way reasoning-gym's prompts ask for it, from the last
``<answer>...</answer>`` (``reasoning_gym.utils.extract_answer``); :func:`reasoning_gym_score_boxed` from the last ``\\boxed{...}`` (arbor's math
convention, :mod:`arbor.rollout.answers`). A completion without one is scored as the
dataset scores no answer (``score_answer(None, item)``: 0 for most, 0.01 for countdown).
"""

from __future__ import annotations

from reasoning_gym.utils import extract_answer

from arbor.dataset_sources import regenerate
from arbor.rollout.answers import last_boxed


def reasoning_gym_score(problem: dict, completion: str) -> float:
    """The dataset's score of the completion's last ``<answer>...</answer>``."""
    return _score(problem, extract_answer(completion, tag_name="answer"))


def reasoning_gym_score_boxed(problem: dict, completion: str) -> float:
    """The dataset's score of the completion's last ``\\boxed{...}``."""
    return _score(problem, last_boxed(completion))


def _score(problem: dict, answer: str | None) -> float:
    dataset, item = regenerate(problem)
    return float(dataset.score_answer(answer, item))
