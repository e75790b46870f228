"""Shared factories for the sample recipes (the "user project" that ampdoctor diagnoses).

Everything here is deterministic: models are built from the global RNG (ampdoctor seeds it
with `torch.manual_seed(seed)` before calling a model factory), data comes from a private
`torch.Generator` seeded with 1234, so it never depends on the global RNG state.

Two settings:

* regression: `make_mlp()` (16 -> 32 -> 1), `make_regression_data()` (x: N x 16, y: N x 1),
  `mse_loss(model, batch)` (mean MSE of one micro-batch).
* token-level: `make_token_model()` (Embedding(50, 16) -> Linear(16, 50)),
  `make_token_batches()` (a list of padded micro-batch dicts whose real-token counts differ
  strongly), `token_loss_sum(model, batch)` -> `(loss_sum, n_tokens)`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 16
HIDDEN = 32
VOCAB = 50
EMBED = 16
IGNORE_INDEX = -100
DATA_SEED = 1234

# Default sizes: 3 optimizer steps x K=4 micro-batches x b=8 samples.
DEFAULT_SAMPLES = 96
# broken_frequent_skips runs 8 optimizer steps: 8 x 4 x 8.
LONG_SAMPLES = 256


# --------------------------------------------------------------------------- regression

def make_mlp() -> nn.Module:
    """A 16 -> 32 -> 1 MLP with a Tanh; no dropout, no batch norm: fully deterministic."""
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 1),
    )


class BackboneHead(nn.Module):
    """The MLP split the way fine-tuning code splits it: a backbone and a regression head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def make_backbone_head() -> nn.Module:
    return BackboneHead()


class MaskedRegressor(nn.Module):
    """A pre-trained model's fine-tuning head: its first parameter, a `mask_token` used only in
    pre-training, gets no gradient here (as a BERT pooler or an unused embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(IN_FEATURES))
        self.body = make_mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_masked_regressor() -> nn.Module:
    return MaskedRegressor()


def make_dropout_mlp() -> nn.Module:
    """The same MLP with dropout between the layers (what a real project often has)."""
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Dropout(0.1),  # BUG: nondeterministic-baseline
        nn.Linear(HIDDEN, 1),
    )


def _regression(n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(n_samples, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g) / IN_FEATURES ** 0.5
    noise = 0.05 * torch.randn(n_samples, 1, generator=g)
    # Targets of magnitude ~0.5 keep fp16 gradients well below overflow at the default scale.
    y = 0.5 * torch.sin(2.0 * (x @ w)) + 0.25 * x[:, :1] + noise
    return x, y


def make_regression_data(n_samples: int = DEFAULT_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, y)`: x is n_samples x 16, y is n_samples x 1. 96 samples = 3 steps x 4 x 8."""
    return _regression(n_samples)


def make_long_regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """256 samples = 8 optimizer steps x K=4 x b=8 (for the skip-rate recipe)."""
    return _regression(LONG_SAMPLES)


def mse_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean squared error of one `(x, y)` micro-batch: a scalar, the micro-batch mean."""
    x, y = batch
    out = model(x)
    return F.mse_loss(out.float(), y.float())


def make_two_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Backbone (first Linear) and head (last Linear) get their own SGD, as in fine-tuning."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    backbone, head = linears[0], linears[-1]
    return [
        torch.optim.SGD(backbone.parameters(), lr=0.05),
        torch.optim.SGD(head.parameters(), lr=0.1),
    ]


# --------------------------------------------------------------------------- token level

class TokenModel(nn.Module):
    """Embedding(50, 16) -> Linear(16, 50): a bag-of-tokens language-model head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.lm_head = nn.Linear(EMBED, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(input_ids))


def make_token_model() -> nn.Module:
    return TokenModel()


# Real (label != -100) tokens per micro-batch; 4 micro-batches per window, 3 windows.
# Within each window the counts differ by up to 12x, as with bucketed variable-length text.
TOKEN_COUNTS = [
    [5, 40, 12, 60],
    [33, 4, 48, 9],
    [20, 64, 7, 26],
]
SEQS_PER_MICRO_BATCH = 2


def _token_micro_batch(n_real: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    b = SEQS_PER_MICRO_BATCH
    # Split the real tokens over the b sequences unevenly, pad to the longest one (+ slack).
    first = max(1, (2 * n_real) // 3)
    lengths = [first, n_real - first]
    t = max(lengths) + 3
    input_ids = torch.zeros(b, t, dtype=torch.long)
    labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(b, t, dtype=torch.long)
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        ids = torch.randint(1, VOCAB, (length + 1,), generator=g)
        input_ids[row, :length] = ids[:-1]
        labels[row, :length] = ids[1:]  # next-token targets, already shifted
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def make_token_batches() -> list[dict[str, torch.Tensor]]:
    """12 micro-batches (3 windows x 4), each `{"input_ids", "labels", "attention_mask"}` of
    shape [2, T_k] with T_k varying; real-token counts per micro-batch are TOKEN_COUNTS."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return [_token_micro_batch(n, g) for window in TOKEN_COUNTS for n in window]


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]):
    """`(loss_sum, n_tokens)`: summed cross-entropy over tokens whose label != -100, and how
    many there were (a float tensor)."""
    logits = model(batch["input_ids"]).float()
    labels = batch["labels"]
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    n_tokens = (labels != IGNORE_INDEX).sum().to(torch.float32)
    return loss_sum, n_tokens


# --------------------------------------------------------------------------- packed LM

PACKED_SEQS, PACKED_LEN = 4, 10


def make_packed_lm_batches() -> list[dict[str, torch.Tensor]]:
    """12 micro-batches of packed text (no padding): `{"input_ids", "labels"}` of shape
    [4, 10], labels equal to input_ids (the model shifts them, as Hugging Face causal LMs do)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    batches = []
    for _ in range(12):
        ids = torch.randint(1, VOCAB, (PACKED_SEQS, PACKED_LEN), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def packed_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy: logits[:, :-1] against labels[:, 1:]."""
    logits = model(batch["input_ids"]).float()[:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
