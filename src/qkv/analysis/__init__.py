"""``qkv.analysis``: what a capture says about a model, as numbers.

* :func:`rollout` and :func:`flow` (Abnar & Zuidema 2020, "Quantifying Attention Flow in
  Transformers"): how much each input token reaches each output position through all layers.
* :func:`head_scores`: a table of (layer, head) -> previous-token, self, first-token (sink),
  local-window mass, entropy and induction scores; :func:`induction_input` builds the repeated
  random sequence the induction score is measured on.
* :func:`compare`: two captures of one architecture, every head's signed difference and the
  heads ranked by how much they changed (mean and max ``|a - b|``).

Everything here reads weights only (a :class:`qkv.Captured`, or plain ``(B, H, T, T)``
tensors); nothing runs a model. ``flow`` needs networkx (a dependency of torch) or scipy
(``pip install qkv[analysis]``), imported when ``flow`` runs: ``import qkv.analysis`` needs
torch only.
"""

from .compare import Comparison, Difference, compare
from .rollout import flow, rollout
from .scores import HeadScores, InductionInput, head_scores, induction_input

__all__ = [
    "Comparison",
    "Difference",
    "HeadScores",
    "InductionInput",
    "compare",
    "flow",
    "head_scores",
    "induction_input",
    "rollout",
]
