"""The outcome model: P(a placement meets its goal), learnt as a correction of the policy's
own confidence, trained with torch and served with numpy.

    logit P = logit(policy's confidence) + w₂ · tanh(W₁ z + b₁) + b₂

``z`` is the decision's feature vector (``features.py``), its measured columns standardised
by the training set's means and spreads. The correction starts at zero (``w₂ = 0``,
``b₂ = 0``), so an untrained model says what the policy said, and weight decay pulls it back
there wherever the outcomes do not push, the harder the fewer outcomes there are (a
Gaussian prior on the weights but the output bias, worth ``prior_outcomes``; the learner
chooses how many, ``promotion.choose_prior``). Each outcome's loss is weighted by its
example's weight (the learner service gives every recorded outcome 1: ``OUTCOME_WEIGHT``).

Training needs torch (the learner service); prediction needs only numpy, and the model
travels as plain numbers (msgspec JSON), so the policy service neither imports torch nor
unpickles anything it reads off the bus.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .features import PRIOR_COLUMN, OutcomeFeatures

HIDDEN = 16
"""Units of the one hidden layer: a few hundred weights, learnable from a few hundred outcomes."""
PRIOR_OUTCOMES = 5.0
"""How many outcomes the prior (no correction) is worth by default: the weights' Gaussian
prior, in the units of the per-outcome loss, is ``prior_outcomes / n · |θ|²``, so it holds
a few outcomes back and lets thousands speak."""
EPOCHS = 300
LEARNING_RATE = 0.03


class OutcomeModel(msgspec.Struct, frozen=True, kw_only=True):
    """A trained outcome model, as plain numbers: its feature layout, the standardisation
    of its inputs and the weights of its correction."""

    features: OutcomeFeatures
    mean: list[float]
    scale: list[float]
    hidden_weight: list[list[float]]
    hidden_bias: list[float]
    out_weight: list[float]
    out_bias: float
    trained_through: float | None = None
    """When the latest outcome it learnt from was recorded (``recorded_at``); ``None``: not
    known (a model stored before this field, or one ``train`` made for a caller that did
    not say). The outcomes recorded after it are the ones it never saw, the only ones it can
    be judged on."""
    columns: list[str] = msgspec.field(default_factory=list)
    """The name of each input column as the learner that trained it laid them out
    (``OutcomeFeatures.names``); empty in a model stored before this field. A reader whose
    layout names them otherwise refuses the model (``check``)."""

    @classmethod
    def from_bytes(cls, value: bytes) -> OutcomeModel:
        """A model as stored in the ``models`` bucket, decoded and checked; ``ValueError``
        with one line when it is not one."""
        try:
            model = msgspec.json.decode(value, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"not an outcome model: {str(exc).splitlines()[0]}") from None
        model.check()
        return model

    def check(self) -> None:
        """Raise ``ValueError`` unless the model was laid out as this version lays out its
        features, every array has the shape the layout asks for and every number is finite (a
        model read off the bus is checked before it is used)."""
        # The width alone let through a model from a version whose columns differ but count
        # the same (a kind renamed, two columns swapped): it loaded, and every prediction
        # read one column as another.
        names = self.features.names()
        if self.columns and self.columns != names:
            at = next((i for i, (a, b) in enumerate(zip(self.columns, names, strict=False)) if a != b),
                      min(len(self.columns), len(names)))
            theirs = self.columns[at] if at < len(self.columns) else "nothing"
            ours = names[at] if at < len(names) else "nothing"
            raise ValueError(f"outcome model: laid out by another version (column {at} is {theirs!r}, "
                             f"{ours!r} here)")
        width = self.features.width()
        if len({len(row) for row in self.hidden_weight}) > 1:
            # numpy's own refusal of a ragged table named neither the model nor the field.
            raise ValueError("outcome model: hidden_weight is not a table (its rows differ in length)")
        shapes = {"mean": (np.asarray(self.mean), (width,)), "scale": (np.asarray(self.scale), (width,)),
                  "hidden_weight": (np.asarray(self.hidden_weight, dtype=float), (len(self.hidden_bias), width)),
                  "out_weight": (np.asarray(self.out_weight), (len(self.hidden_bias),))}
        for name, (array, shape) in shapes.items():
            if array.shape != shape:
                raise ValueError(f"outcome model: {name} has shape {array.shape}, the layout needs {shape}")
            if not np.isfinite(array).all():
                raise ValueError(f"outcome model: {name} holds a number that is not finite")
        if not np.isfinite(self.out_bias) or not np.isfinite(self.hidden_bias).all():
            raise ValueError("outcome model: a bias is not finite")
        if (np.asarray(self.scale) <= 0).any():
            raise ValueError("outcome model: a scale is not positive")

    def predict(self, x: np.ndarray) -> np.ndarray:
        """P(success) of each row of ``x`` (rows laid out by ``self.features``)."""
        x = np.atleast_2d(np.asarray(x, dtype=float))
        z = (x - np.asarray(self.mean)) / np.asarray(self.scale)
        hidden = np.tanh(z @ np.asarray(self.hidden_weight).T + np.asarray(self.hidden_bias))
        correction = hidden @ np.asarray(self.out_weight) + self.out_bias
        return 1.0 / (1.0 + np.exp(-(x[:, PRIOR_COLUMN] + correction)))


def prior_probability(x: np.ndarray) -> np.ndarray:
    """The policy's own confidence of each row (what an untrained model predicts)."""
    return 1.0 / (1.0 + np.exp(-np.atleast_2d(x)[:, PRIOR_COLUMN]))


def train(features: OutcomeFeatures, x: np.ndarray, success: np.ndarray, weight: np.ndarray, *,
          seed: int = 0, epochs: int = EPOCHS, prior_outcomes: float = PRIOR_OUTCOMES) -> OutcomeModel:
    """Fit the correction to outcomes ``success`` (1 = the goal was met) of rows ``x``, each
    counted ``weight`` times, under a prior worth ``prior_outcomes``; the same inputs and
    ``seed`` give the same model."""
    import torch  # only the learner trains; importing torch costs the policy service nothing

    x = np.asarray(x, dtype=float)
    if x.ndim != 2 or x.shape[1] != features.width() or len(x) != len(success) or len(x) != len(weight):
        raise ValueError(f"train: {x.shape} rows for a layout of {features.width()} columns, "
                         f"{len(success)} outcomes, {len(weight)} weights")
    if len(x) == 0:
        raise ValueError("train: no outcomes to learn from")
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    # Indicator columns stay 0/1: standardised, a rare one (the one best-effort task in a
    # hundred) would read as a value of ten, and the few outcomes it has would move every
    # prediction of its kind that far. A constant column (a GPU model never seen) stays too.
    indicator = ((x == 0.0) | (x == 1.0)).all(axis=0)
    keep = indicator | (scale < 1e-9)
    mean[keep], scale[keep] = 0.0, 1.0
    with torch.random.fork_rng(devices=[]):  # the seed decides this model, nothing else's draws
        torch.manual_seed(seed)
        hidden = torch.nn.Linear(features.width(), HIDDEN, dtype=torch.float64)
        out = torch.nn.Linear(HIDDEN, 1, dtype=torch.float64)
    torch.nn.init.zeros_(out.weight)
    torch.nn.init.zeros_(out.bias)
    z = torch.tensor((x - mean) / scale)
    prior = torch.tensor(x[:, PRIOR_COLUMN])
    y = torch.tensor(np.asarray(success, dtype=float))
    w = torch.tensor(np.clip(np.asarray(weight, dtype=float), 0.0, None))
    total = float(w.sum()) or 1.0
    params = [*hidden.parameters(), *out.parameters()]
    optimiser = torch.optim.Adam(params, lr=LEARNING_RATE)
    for _ in range(epochs):
        optimiser.zero_grad()
        logits = prior + out(torch.tanh(hidden(z))).squeeze(-1)
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none") * w).sum() / total
        # The output bias is left free: it is the one shift of every prediction (calibration in
        # the large), which any number of outcomes can teach; the prior holds the rest.
        loss = loss + prior_outcomes / total * sum((p ** 2).sum() for p in (*hidden.parameters(), out.weight))
        loss.backward()
        optimiser.step()
    return OutcomeModel(
        features=features, mean=mean.tolist(), scale=scale.tolist(),
        hidden_weight=hidden.weight.detach().numpy().tolist(), hidden_bias=hidden.bias.detach().numpy().tolist(),
        out_weight=out.weight.detach().numpy()[0].tolist(), out_bias=float(out.bias.detach().numpy()[0]),
        columns=features.names())
