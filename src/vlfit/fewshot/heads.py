"""Linear classifiers on L2-normalized image embeddings: ``softmax(x @ weight.T + bias)`` over the classes.

Three ways to get one: the zero-shot head (class-name prompts through the text tower), logistic regression on the
shots' embeddings (scikit-learn, its inverse regularization ``C`` chosen by cross-validation on the shots where
each class has at least two), and logistic regression pulled toward the zero-shot head instead of toward zero
(``anchored``): with very few shots it keeps what the text tower knows about the class names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Inverse regularization strengths tried by cross-validation. Embeddings have unit norm, so useful values are large.
C_GRID: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0, 1000.0)
# C where the shots are too few to cross-validate (one per class): the grid's middle.
DEFAULT_C = 10.0
# Strengths of the pull toward the zero-shot head tried by cross-validation, and the one used with a single shot.
ANCHOR_STRENGTHS: tuple[float, ...] = (0.001, 0.01, 0.1)
DEFAULT_ANCHOR_STRENGTH = 0.01
MAX_FOLDS = 5


@dataclass
class LinearHead:
    """Attributes:
    weight: ``float32 [C, D]``.
    bias: ``float32 [C]``.
    """

    weight: torch.Tensor
    bias: torch.Tensor

    def logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings.float() @ self.weight.T + self.bias

    def probabilities(self, embeddings: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(embeddings), dim=-1)

    def predict(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.logits(embeddings).argmax(dim=-1)


def zeroshot_head(class_embeddings: torch.Tensor, scale: float) -> LinearHead:
    """The head that scores an image by ``scale`` times its cosine similarity with each class's text embedding."""
    weight = scale * class_embeddings.float()
    return LinearHead(weight, torch.zeros(len(weight)))


HeadFit = Callable[[torch.Tensor, np.ndarray], LinearHead]


def _folds(labels: np.ndarray) -> int:
    """Cross-validation folds the shots allow: at most ``MAX_FOLDS``, at most the smallest class's count."""
    return min(MAX_FOLDS, int(np.bincount(labels).min()))


def sklearn_logistic_head(embeddings: torch.Tensor, labels: np.ndarray, c: float, num_classes: int) -> LinearHead:
    """Multinomial logistic regression (scikit-learn, L-BFGS, L2 with inverse strength ``c``)."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=c, max_iter=2000)
    model.fit(embeddings.float().numpy(), labels)
    if len(model.classes_) != num_classes:
        raise ValueError(f"the shots hold {len(model.classes_)} of the {num_classes} classes")
    coef = torch.from_numpy(np.asarray(model.coef_, dtype=np.float32))
    intercept = torch.from_numpy(np.asarray(model.intercept_, dtype=np.float32))
    if coef.shape[0] == 1:  # two classes: scikit-learn keeps one logit; softmax([-z/2, z/2]) = sigmoid(z)
        coef = torch.cat([-coef / 2, coef / 2])
        intercept = torch.cat([-intercept / 2, intercept / 2])
    return LinearHead(coef, intercept)


def anchored_head(
    embeddings: torch.Tensor, labels: np.ndarray, anchor: LinearHead, strength: float, steps: int = 100
) -> LinearHead:
    """Logistic regression regularized toward ``anchor`` (the zero-shot head) rather than toward zero.

    Minimizes ``mean cross-entropy + strength / 2 * ||W - W_anchor||^2`` (the bias is free) with L-BFGS, starting
    from the anchor; ``strength`` plays the part of ``1 / (C * n)`` in scikit-learn's parametrization.
    """
    # Clones: the embeddings may come from inference mode, whose tensors autograd cannot save.
    x = embeddings.float().clone()
    y = torch.as_tensor(labels, dtype=torch.long)
    target = anchor.weight.clone()
    weight = anchor.weight.clone().requires_grad_(True)
    bias = anchor.bias.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y)
        loss = loss + strength / 2 * (weight - target).pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return LinearHead(weight.detach(), bias.detach())


def logistic_name(c: float) -> str:
    """A plain logistic head's candidate name (what results report as its head)."""
    return f"logistic C={c:g}"


def anchored_name(strength: float) -> str:
    """An anchored head's candidate name."""
    return f"anchored strength={strength:g}"


def logistic_candidates(num_classes: int) -> dict[str, HeadFit]:
    """Plain logistic regression at each ``C`` of ``C_GRID``, by name."""
    return {logistic_name(c): (lambda x, y, c=c: sklearn_logistic_head(x, y, c, num_classes)) for c in C_GRID}


def anchored_candidates(anchor: LinearHead, strengths: Sequence[float] = ANCHOR_STRENGTHS) -> dict[str, HeadFit]:
    """Logistic regression anchored at the zero-shot head, at each of ``strengths``, by name."""
    return {anchored_name(s): (lambda x, y, s=s: anchored_head(x, y, anchor, s)) for s in strengths}


def cross_validated_scores(
    fit: HeadFit, embeddings: torch.Tensor, labels: np.ndarray, seed: int
) -> tuple[float, float]:
    """Accuracy and mean log-likelihood of ``fit`` over stratified folds of the shots (each held out once)."""
    from sklearn.model_selection import StratifiedKFold

    folds = StratifiedKFold(n_splits=_folds(labels), shuffle=True, random_state=seed)
    correct, log_likelihood = 0, 0.0
    for train, held in folds.split(embeddings.numpy(), labels):
        head = fit(embeddings[train], labels[train])
        log_probabilities = torch.log_softmax(head.logits(embeddings[held]), dim=-1)
        truth = torch.as_tensor(labels[held])
        correct += int((log_probabilities.argmax(dim=-1) == truth).sum())
        log_likelihood += float(log_probabilities.gather(1, truth[:, None]).sum())
    return correct / len(labels), log_likelihood / len(labels)


def choose_head(
    embeddings: torch.Tensor, labels: np.ndarray, candidates: dict[str, HeadFit], fallback: str, seed: int
) -> tuple[LinearHead, str]:
    """The candidate with the best cross-validated accuracy on the shots, fit on all of them; ties (a few shots
    give few distinct accuracies) go to the better held-out log-likelihood, then to the first. ``fallback`` when
    some class has a single shot, which leaves nothing to validate on.

    Returns:
        The head and its candidate's name.
    """
    embeddings = embeddings.float()
    name = fallback
    if _folds(labels) >= 2:
        scores = {key: cross_validated_scores(fit, embeddings, labels, seed) for key, fit in candidates.items()}
        name = max(scores, key=scores.__getitem__)
    return candidates[name](embeddings, labels), name
