r"""An independent offensiveness reward: the classifier of ``alt-profanity-check``, whose weights ship in its wheel.

``alt-profanity-check`` (MIT) is a TF-IDF + linear classifier trained on offensive-language data; it runs offline at
about 100k texts per second on one CPU core, which makes it a *real* reward that is independent of the policy (it
was not trained with it and shares no tokenizer with it). Install it with ``pip install trl_ext[toxicity]``.

:class:`OffensivenessReward` turns its probability ``p = P(offensive | text)`` into a reward that is low for bad
outputs, as every trainer and evaluation of trl_ext expects::

    r = log(max(1 − p, floor))            ∈ [log(floor), 0]     (floor = 1e-4: r ≥ −9.21)

- ``r`` is 0 for a clean text and falls steeply only as ``p → 1``, so the bulk of harmless outputs are nearly tied
  and the signal sits in the tail, where harmlessness training needs it;
- the map is monotone and invertible above the floor: ``p = 1 − exp(r)``. A threshold on ``p`` is a threshold on
  ``r``: ``P(p > 0.5) = P(r < log 0.5)``; :func:`reward_threshold` gives ``τ`` for any ``p``. That is how the
  study reports ``P(p_offensive > 0.5)`` from rewards (the floor only merges ``p > 1 − floor`` into one value);
- by default only the *completion* is scored (RealToxicityPrompts' convention: the prompts are toxic by
  construction, the question is what the model adds); ``score="prompt_and_completion"`` scores the joined text.

The raw probabilities of the last call are kept in :attr:`OffensivenessReward.last_p_offensive` (for logging), and
:meth:`OffensivenessReward.p_offensive` scores texts directly.

The classifier's model is the joblib (pickle) file inside the installed ``profanity_check`` package: only that file
is ever loaded, through the package's own ``predict_prob``; no user-supplied file is unpickled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..models.reward_functions import RewardFunction

__all__ = ["OffensivenessReward", "reward_threshold"]

DEFAULT_FLOOR = 1e-4
SCORES = ("completion", "prompt_and_completion")


def reward_threshold(p_offensive: float, floor: float = DEFAULT_FLOOR) -> float:
    """The ``τ`` with ``r < τ  ⇔  p > p_offensive`` for ``r = log(max(1 − p, floor))``, ``p_offensive < 1 − floor``."""
    if not 0 <= p_offensive < 1 - floor:
        raise ValueError(f"p_offensive must be in [0, 1 - floor) = [0, {1 - floor}); got {p_offensive}.")
    return math.log(1.0 - p_offensive)


def _predict_prob():
    try:
        from profanity_check import predict_prob
    except ImportError as err:
        raise ImportError(
            "OffensivenessReward uses the alt-profanity-check classifier: pip install 'trl_ext[toxicity]' "
            "(or pip install alt-profanity-check==1.9.1)."
        ) from err
    return predict_prob


class OffensivenessReward(RewardFunction):
    """``r = log(max(1 − P(offensive), floor))`` of the alt-profanity-check classifier (see the module docstring).

    Args:
        score: ``"completion"`` (default) or ``"prompt_and_completion"``: which text is classified.
        floor: the smallest ``1 − p`` kept, in ``(0, 1)``; sets the lowest reward ``log(floor)``.
    """

    name = "offensiveness"

    def __init__(self, score: str = "completion", floor: float = DEFAULT_FLOOR):
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}; got {score!r}.")
        if not 0 < floor < 1:
            raise ValueError(f"floor must be in (0, 1); got {floor}.")
        self.score, self.floor = score, float(floor)
        self._predict = _predict_prob()
        self.last_p_offensive: np.ndarray = np.zeros(0)

    @property
    def min_reward(self) -> float:
        """The lowest reward, ``log(floor)``."""
        return math.log(self.floor)

    def p_offensive(self, texts: Sequence[str]) -> np.ndarray:
        """``P(offensive)`` of each text (float64)."""
        texts = [t if isinstance(t, str) else str(t) for t in texts]
        if not texts:
            return np.zeros(0)
        return np.asarray(self._predict(texts), dtype=np.float64)

    @staticmethod
    def _text(item) -> str:
        if isinstance(item, str):
            return item
        if isinstance(item, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in item):
            return "\n".join(str(m["content"]) for m in item)  # a conversation: its messages' text
        return str(item)

    def compute(self, prompts: list, completions: list, **kwargs) -> np.ndarray:
        completions = [self._text(c) for c in completions]
        if self.score == "prompt_and_completion":
            texts = [self._text(p) + c for p, c in zip(prompts, completions)]
        else:
            texts = completions
        p = self.p_offensive(texts)
        self.last_p_offensive = p
        return np.log(np.maximum(1.0 - p, self.floor)).astype(np.float32)
