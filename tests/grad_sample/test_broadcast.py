"""Layers applied to inputs every sample shares (position ids, a fixed query): exact per-sample
gradients in hooks and ghost mode; the batch of a pass comes from the model's input."""

import pytest
import torch
from torch import nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.batch import PassBatch
from dptrain.grad_sample.broadcast import EXPAND, PREPEND, BatchProvenance, broadcast_rule, from_batch
from dptrain.grad_sample.module import GradSampleModule
from tests.grad_sample.conftest import assert_per_sample_exact
from tests.grad_sample.test_ghost_support import F64, REGIMES, assert_ghost_matches_hooks

VOCAB, DIM = 9, 4


class Positions(nn.Module):
    """``tok(ids) + pos(positions)`` then a Linear, with positions ``[1, T]`` ("row"), ``[T]``
    ("flat", nanoGPT's ``arange(T)``) or computed first ("row_first": the position embedding is
    the first layer to run). ``batch_first=False`` models take ids ``[T, B]``."""

    def __init__(self, layout: str, batch_first: bool = True) -> None:
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(VOCAB, DIM), nn.Embedding(8, DIM), nn.Linear(DIM, 3)
        self.layout, self.batch_first = layout, batch_first

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        steps = ids.shape[1] if self.batch_first else ids.shape[0]
        positions = torch.arange(steps)
        if self.layout == "flat":
            p = self.pos(positions)  # [T, D]: broadcast over the batch whatever the layout
            p = p if self.batch_first else p.unsqueeze(1)
        else:
            p = self.pos(positions.unsqueeze(0) if self.batch_first else positions.unsqueeze(1))
        return self.out(torch.tanh(self.tok(ids) + p))


class FixedQuery(nn.Module):
    """Attention pooling with a fixed query ``[1, D]`` projected by a trainable Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("query", torch.randn(1, DIM, dtype=F64))
        self.q, self.k = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bd,btd->bt", self.q(self.query), self.k(x))
        return torch.einsum("bt,btd->bd", scores.softmax(dim=1), x)


LAYOUTS = ["row", "flat", "row_first"]


def _ids(batch: int, steps: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, steps))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_position_embeddings_get_exact_per_sample_gradients(layout, random_targets) -> None:
    model, ids = Positions(layout).double(), _ids(3, 5)
    assert_per_sample_exact(model, ids, random_targets(model, ids))


@pytest.mark.parametrize("layout", ["row", "flat"])
def test_positions_are_told_from_the_batch_when_the_sequence_is_as_long_as_the_batch(layout, random_targets) -> None:
    model, ids = Positions(layout).double(), _ids(4, 4)
    assert_per_sample_exact(model, ids, random_targets(model, ids))


def _time_major_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Output ``[T, B, 3]`` weighted by targets ``[B, T, 3]`` (sum reduction)."""
    return (output.transpose(0, 1) * target).sum()


_time_major_loss.reduction = "sum"


def test_sequence_first_positions_with_a_batch_dimension_of_one_get_exact_per_sample_gradients(random_targets) -> None:
    model, ids = Positions("row", batch_first=False).double(), _ids(5, 3)  # ids [T, B], positions [T, 1]
    targets = random_targets(model, ids).transpose(0, 1)
    assert_per_sample_exact(model, ids, targets, _time_major_loss, batch_first=False)


def test_sequence_first_positions_without_batch_dimension_are_refused_with_the_fix() -> None:
    gsm = GradSampleModule(Positions("flat", batch_first=False).double(), batch_first=False)
    with pytest.raises(UnsupportedModuleError, match=r"'pos'.*batch dimension of size 1"):
        gsm(_ids(5, 3))


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ghost_clipping_of_position_embeddings_equals_hooks_mode(layout, regime) -> None:
    ghost = assert_ghost_matches_hooks(Positions(layout).double(), (_ids(4, 4),), regime)
    assert ghost.layer_strategies()["pos"] == "ghost"


def test_a_fixed_query_of_batch_size_one_gets_exact_per_sample_gradients(random_targets) -> None:
    model, x = FixedQuery().double(), torch.randn(3, 5, DIM, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))
    assert_ghost_matches_hooks(model, (x,), "mixed")


def test_an_input_whose_batch_dimension_cannot_be_broadcast_is_refused_naming_the_layer() -> None:
    class Mismatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.extra = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).sum() + self.extra(torch.cat([x, x[:1]])).sum()  # B + 1 rows

    with pytest.raises(UnsupportedModuleError, match=r"'extra'.*size 4.*batch of 3 examples"):
        GradSampleModule(Mismatch())(torch.randn(3, 2))


class BatchContext(nn.Module):
    """``fc(x + ctx(c))`` where the context ``c`` is computed from the batch ``x`` ``[B, T, 3]``
    (it mixes samples: sample b's gradient depends on the others' data)."""

    CONTEXTS = {
        "mean_keepdim": lambda x: x.mean(0, keepdim=True),  # [1, T, 3]
        "first_row": lambda x: x[:1],  # [1, T, 3]
        "first_sample": lambda x: x[0],  # [T, 3], shaped like one example
        "mean": lambda x: x.mean(0),  # [T, 3]
    }

    def __init__(self, context: str) -> None:
        super().__init__()
        self.context = self.CONTEXTS[context]
        self.ctx, self.fc = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x + self.ctx(self.context(x))))


@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("context", list(BatchContext.CONTEXTS))
def test_a_layer_input_computed_from_the_batch_is_refused_not_taken_as_shared(context, batch) -> None:
    gsm = GradSampleModule(BatchContext(context).double())
    with pytest.raises(UnsupportedModuleError, match=r"'ctx'.*batch of %d examples" % batch):
        gsm(torch.randn(batch, 5, 3, dtype=F64))


class StackedIds(nn.Module):
    """Token ids and mask stacked in one input ``[B, 2, T]``: at B == 2 the ids ``[B, T]`` are
    shaped like one example of the input, and nanoGPT-style positions ``arange(T)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(VOCAB, DIM), nn.Embedding(8, DIM), nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, mask = x[:, 0], x[:, 1]
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.out(torch.tanh(h)) * mask.unsqueeze(-1)


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_ids_shaped_like_one_example_of_the_input_are_per_sample(batch, random_targets) -> None:
    x = torch.stack([_ids(batch, 5), torch.randint(0, 2, (batch, 5))], dim=1)
    model = StackedIds().double()
    assert_per_sample_exact(model, x, random_targets(model, x))


class FeaturePositions(nn.Module):
    """A time-series model: features ``[B, T, 3]`` projected, plus nanoGPT-style ``wpe(arange(T))``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.wpe, self.out = nn.Linear(3, DIM), nn.Embedding(8, DIM), nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x) + self.wpe(torch.arange(x.shape[1]))))


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_positions_of_a_model_with_feature_inputs_are_exact_when_the_batch_is_as_long_as_the_sequence(
    batch, random_targets
) -> None:
    model, x = FeaturePositions().double(), torch.randn(batch, 5, 3, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("batch", [1, 5])
def test_ghost_clipping_of_feature_model_positions_equals_hooks_mode(batch, regime) -> None:
    x = torch.randn(batch, 5, 3, dtype=F64)
    ghost = assert_ghost_matches_hooks(FeaturePositions().double(), (x,), regime)
    assert ghost.layer_strategies()["wpe"] == "ghost"


@pytest.mark.parametrize("batch, steps", [(1, 5), (2, 5), (5, 5), (3, 1)])
def test_positions_without_batch_dimension_are_exact_at_every_batch_size_and_length(
    batch, steps, random_targets
) -> None:
    model, ids = Positions("flat").double(), _ids(batch, steps)
    gsm = GradSampleModule(model)
    wrapped_shape = gsm(ids).shape
    gsm.remove_hooks()
    assert wrapped_shape == model(ids).shape
    assert_per_sample_exact(model, ids, random_targets(model, ids))


class GivenPositions(Positions):
    """:class:`Positions` with the position ids ``[1, T]`` passed by the caller as an argument."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.tok(ids) + self.pos(positions)))


def test_position_ids_passed_to_the_model_are_per_sample_data_and_need_the_batch_dimension(random_targets) -> None:
    model, ids = GivenPositions("row").double(), _ids(3, 5)
    positions = torch.arange(5).unsqueeze(0)
    with pytest.raises(UnsupportedModuleError, match=r"'pos'.*size 1.*not from its arguments"):
        GradSampleModule(model)(ids, positions)


class ProjectedFeatures(nn.Module):
    """``fc(tok(ids) + proj(feats))`` with fixed features ``[T, 3]`` (a buffer, no batch dimension)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.register_buffer("feats", torch.randn(steps, 3, dtype=F64))
        self.tok, self.proj, self.fc = nn.Embedding(VOCAB, DIM), nn.Linear(3, DIM), nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.tok(ids) + self.proj(self.feats)))


@pytest.mark.parametrize("batch", [2, 5])
def test_a_shared_input_whose_batch_dimension_cannot_be_told_is_refused_at_every_batch_size(batch) -> None:
    gsm = GradSampleModule(ProjectedFeatures(steps=5).double())
    with pytest.raises(UnsupportedModuleError, match=r"'proj'.*\(5, 3\).*does not depend on the model's inputs"):
        gsm(_ids(batch, 5))


class Latents(nn.Module):
    """A learned table ``[Q, D]`` returned by a layer that takes no input."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(count, DIM))

    def forward(self) -> torch.Tensor:
        return self.table


class LatentQueries(nn.Module):
    """Cross-attention scores of Q learned queries against the inputs ``[B, T, D]`` -> ``[B, Q]``."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.latents, self.k = Latents(count), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("qd,btd->bq", self.latents(), self.k(x))


def test_a_shared_output_of_a_layer_without_input_is_refused_even_when_it_has_batch_rows() -> None:
    gsm = GradSampleModule(LatentQueries(count=3).double())
    with pytest.raises(UnsupportedModuleError, match=r"'latents'.*took no tensor input"):
        gsm(torch.randn(3, 5, DIM, dtype=F64))


class IndexedPositions(nn.Module):
    """HF-style position ids ``[1, T]`` (a buffer) whose embedding is indexed ``[0]`` to ``[T, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(8).unsqueeze(0))
        self.tok, self.wpe, self.fc = nn.Embedding(VOCAB, DIM), nn.Embedding(8, DIM), nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = self.wpe(self.position_ids[:, : ids.shape[1]])[0]
        return self.fc(torch.tanh(self.tok(ids) + positions))


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_indexing_the_batch_of_a_shared_output_is_refused_naming_the_layer(batch) -> None:
    gsm = GradSampleModule(IndexedPositions().double())
    with pytest.raises(UnsupportedModuleError, match=r"'wpe'.*'__getitem__'.*wpe\(position_ids\[0\]\)"):
        gsm(_ids(batch, 5))


def test_provenance_marks_what_is_computed_from_the_model_arguments_and_nothing_else() -> None:
    x, buffer = torch.randn(3, 4), torch.zeros(2, 4)
    with BatchProvenance((x,), {}):
        derived, constant, sliced = torch.tanh(x * 2)[:1], torch.arange(4), buffer[:, :2]
        written = torch.zeros(4)
        written.copy_(x[0])
        into_view = torch.zeros(2, 4)
        into_view[:1] += x[:1]
    assert from_batch(x) and from_batch(derived) and from_batch(written) and from_batch(into_view)
    assert not from_batch(constant) and not from_batch(sliced) and not from_batch(buffer)


def test_the_broadcast_rule_reads_provenance_then_layout() -> None:
    batch, row = PassBatch(4, "args[0]"), torch.zeros(1, 4)
    assert broadcast_rule("layer", [row], row, batch, 0) == EXPAND
    assert broadcast_rule("layer", [torch.arange(4)], torch.zeros(4, 2), batch, 0) == PREPEND
    expanded = torch.zeros(1, 4).expand(4, 4)  # already given the batch, as BERT's token types
    assert broadcast_rule("layer", [expanded], expanded, batch, 0) is None
    x = torch.zeros(4, 4)
    with BatchProvenance((x,), {}):
        first_row = x[:1] * 2  # computed from the batch: never shared, left to the batch check
    assert broadcast_rule("layer", [first_row], first_row, batch, 0) is None
    with pytest.raises(UnsupportedModuleError, match=r"'layer'.*\(4, 4\)"):
        broadcast_rule("layer", [torch.zeros(4, 4)], torch.zeros(4, 4), batch, 0)
