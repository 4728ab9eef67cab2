"""Code that runs inside the spawned ranks of the FSDP2 tests (and, for the references, in the
test process itself): the same private training on a model sharded with `fully_shard` over the
ranks, or whole on one process. Launched with `ddp_workers.run_ranks` (forked gloo ranks)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_workers
from ddp_workers import init_gloo

# Imported here, in the test process, so that the forked ranks inherit them.
import torch.distributed.fsdp  # noqa: F401,E402
import torch.distributed.tensor  # noqa: F401,E402
import dptrain.distributed.fsdp  # noqa: F401,E402

SEED = 1234
N = 40


def mlp_problem() -> tuple[nn.Module, TensorDataset, Callable[[nn.Module, Any], torch.Tensor]]:
    """The DDP tests' float64 MLP and dataset, and its loss(module, batch): the batch mean, 0 on
    an empty batch (whose forward and backward every rank of a sharded model must run)."""
    model, data = ddp_workers.make_problem()

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(module(x), y, reduction="sum") / max(len(x), 1)

    return model, data, loss


VOCAB, SEQ, WIDTH = 30, 6, 16


def _token_data(labels: torch.Tensor | None = None) -> TensorDataset:
    """N random token sequences [N, SEQ] (and `labels`), identical on every rank."""
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (N, SEQ), generator=gen)
    return TensorDataset(ids) if labels is None else TensorDataset(ids, labels)


def gpt2_problem() -> tuple[nn.Module, TensorDataset, Callable[[nn.Module, Any], torch.Tensor]]:
    """A tiny float64 GPT-2 LM whose head is tied to its token embedding; loss: each sequence's
    mean next-token loss, averaged over the batch."""
    import transformers as t

    torch.manual_seed(SEED)
    model = t.GPT2LMHeadModel(t.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=2, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)).double()
    assert model.lm_head.weight is model.transformer.wte.weight

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        (ids,) = batch
        logits = module(input_ids=ids).logits[:, :-1]
        per_token = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        return per_token.mean(dim=1).mean()

    return model, _token_data(), loss


def gpt2_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h)


def bert_lora_problem() -> tuple[nn.Module, TensorDataset, Callable[[nn.Module, Any], torch.Tensor]]:
    """A tiny float64 BERT classifier with LoRA adapters (rank 2) on query and value, only the
    adapters trainable."""
    import peft
    import transformers as t

    torch.manual_seed(SEED)
    base = t.BertForSequenceClassification(t.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * WIDTH, max_position_embeddings=SEQ, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                      target_modules=["query", "value"]))
    for name, p in model.named_parameters():  # LoRA's B starts at 0: start it away from 0
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    labels = torch.randint(0, 2, (N,), generator=torch.Generator().manual_seed(SEED + 1))

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        ids, y = batch
        return nn.functional.cross_entropy(module(input_ids=ids).logits, y)

    return model, _token_data(labels), loss


CLASSIFIERS = ("bert", "roberta", "gpt2", "llama")  # post-LN (units end in a LayerNorm), pre-LN


def tiny_classifier(kind: str) -> nn.Module:
    """A tiny float64 2-class sequence classifier of `kind` (one of CLASSIFIERS), every weight
    trainable, no dropout, pad token 0. BERT's and RoBERTa's layers end in a LayerNorm whose
    output is the layer's output; GPT-2's and Llama's in a residual sum."""
    import transformers as t

    torch.manual_seed(SEED)
    common = dict(vocab_size=VOCAB, num_labels=2, pad_token_id=0)
    if kind == "gpt2":
        config = t.GPT2Config(n_embd=WIDTH, n_layer=2, n_head=2, n_positions=SEQ, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return t.GPT2ForSequenceClassification(config).double()
    if kind == "llama":
        config = t.LlamaConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2,
                               max_position_embeddings=SEQ, **common)
        return t.LlamaForSequenceClassification(config).double()
    bert = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=2 * WIDTH, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, **common)
    if kind == "roberta":  # positions start after the pad id
        return t.RobertaForSequenceClassification(
            t.RobertaConfig(max_position_embeddings=SEQ + 2, **bert)).double()
    return t.BertForSequenceClassification(t.BertConfig(max_position_embeddings=SEQ, **bert)).double()


def classifier_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a `tiny_classifier` (its FSDP units)."""
    base = getattr(model, model.base_model_prefix)
    return list(base.h if hasattr(base, "h") else base.layers if hasattr(base, "layers")
                else base.encoder.layer)


def squared_norms_of_one_batch(source: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: Tensor[4]}: the squared per-example norms `source` (hooks or ghost,
    wrapping `model`) gives after one backward of a fixed batch of 4 token sequences (no pad)."""
    g = torch.Generator().manual_seed(SEED)
    ids, y = torch.randint(1, VOCAB, (4, SEQ), generator=g), torch.tensor([0, 1, 1, 0])
    nn.functional.cross_entropy(source(input_ids=ids).logits, y).backward()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: v.detach().clone() for p, v in source.squared_norms().items()}


class InPlaceAfterUnit(nn.Module):
    """A float64 block (an FSDP unit ending in a Linear) whose caller scales its output IN PLACE
    (`h.mul_(2)`), then a head: backward through the unit needs FSDP's pre-backward hook on the
    unit's output (which gathers the unit's parameters) to survive the in-place op."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        h.mul_(2.0)
        return self.head(torch.tanh(h))

    @staticmethod
    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed batch of 4 examples: x [4, 4] float64, y [4]."""
        g = torch.Generator().manual_seed(SEED)
        return torch.randn(4, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0])


def in_place_norms_of_one_batch(source: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: Tensor[4]}: the squared per-example norms `source` gives after one
    backward of `InPlaceAfterUnit.batch()` (mean loss)."""
    x, y = InPlaceAfterUnit.batch()
    nn.functional.cross_entropy(source(x), y).backward()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: v.detach().clone() for p, v in source.squared_norms().items()}


def _recording_view_warnings(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """fn()'s result (or the error it raised, as text: every rank raises alike, so the next
    case still runs in step) and FSDP's warnings that a unit returned a view, raised meanwhile."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except Exception as error:  # noqa: BLE001 - reported by the test of that case
            result = f"{type(error).__name__}: {error}"
    return result, [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


def classifier_norms_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """`squared_norms_of_one_batch` of each `tiny_classifier` sharded one unit per block, then the
    root, and `in_place_norms_of_one_batch` of `InPlaceAfterUnit` (kind "in_place"), in hooks and
    in ghost mode: {"norms": {"kind/mode": norms, or the error it raised}, "view_warnings":
    {"kind/mode": FSDP's warnings that a unit returned a view}}."""
    from dptrain.distributed.fsdp import sharded_source

    init_gloo(rank, world_size, port)
    norms: dict[str, Any] = {}
    view_warnings: dict[str, list[str]] = {}
    cases = [(kind, tiny_classifier, classifier_blocks, squared_norms_of_one_batch)
             for kind in CLASSIFIERS]
    cases.append(("in_place", lambda _: InPlaceAfterUnit(), lambda m: [m.block],
                  in_place_norms_of_one_batch))
    for kind, build, units, norms_of in cases:
        for mode in ("hooks", "ghost"):
            model = _shard(build(kind), units)
            norms[f"{kind}/{mode}"], view_warnings[f"{kind}/{mode}"] = _recording_view_warnings(
                lambda: norms_of(sharded_source(model, mode, True, "mean"), model))
    return {"norms": norms, "view_warnings": view_warnings}


def bert_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.base_model.model.bert.encoder.layer)


def _shard(model: nn.Module, units: Callable[[nn.Module], list[nn.Module]],
           mp_policy: Any = None) -> nn.Module:
    """fully_shard each of `units(model)`, then the root."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for unit in units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_parameters(module: nn.Module) -> torch.Tensor:
    """Every parameter, gathered when sharded, flattened in model order."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                      for p in module.parameters()])


def no_units(model: nn.Module) -> list[nn.Module]:
    return []


def first_layer(model: nn.Module) -> list[nn.Module]:
    return [model[0]]


def mlp_float32_problem() -> tuple[nn.Module, TensorDataset, Callable[[nn.Module, Any], torch.Tensor]]:
    """The MLP problem in float32 (for bf16 mixed precision)."""
    model, data, loss = mlp_problem()
    x, y = data.tensors
    return model.float(), TensorDataset(x.float(), y), loss


def train_private(problem: Callable[[], tuple], sharded: bool, steps: int,
                  noise_multiplier: float, grad_sample_mode: str = "hooks", lr: float = 0.5,
                  batch: int = 10, units: Callable[[nn.Module], list[nn.Module]] = no_units,
                  mixed_precision: bool = False, max_grad_norm: float = 0.3,
                  physical: int | None = None, clipping: str = "flat",
                  count_noise_std: float | None = None) -> dict[str, Any]:
    """`steps` DP-SGD steps on `problem()`, fully sharded (with bf16 `mixed_precision`) when
    `sharded`: the final parameters (gathered), the accountant's history and epsilon, every
    step's noise of this rank's rows in gradient units (p.grad - p.summed_grad / B) and the
    dtypes of the clipped sums. `physical`: chunks of at most that many rows (BatchMemoryManager),
    every chunk run, empty ones included. `clipping`, `count_noise_std`: make_private's."""
    from dptrain import BatchMemoryManager
    from dptrain.privacy.engine import PrivacyEngine

    model, data, loss_fn = problem()
    mp_policy = dptrain.distributed.fsdp.bf16_policy() if mixed_precision else None
    if sharded:
        model = _shard(model, units, mp_policy)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    engine = PrivacyEngine(accountant="rdp", seed=SEED, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        grad_sample_mode=grad_sample_mode, clipping=clipping, count_noise_std=count_noise_std)
    noises: list[torch.Tensor] = []
    sum_dtypes: set[str] = set()
    counts: list[float] = []  # adaptive clipping: each step's centred unclipped count (all ranks)
    optimizer.attach_step_hook(lambda opt: counts.append(getattr(opt.clipper, "centred_count", 0.0)))
    optimizer.attach_step_hook(lambda opt: noises.append(torch.cat(
        [_local(p.grad - p.summed_grad / opt.expected_batch_size).flatten() for p in opt.params])))
    optimizer.attach_step_hook(lambda opt: sum_dtypes.update(str(p.summed_grad.dtype)
                                                             for p in opt.params))
    done, batches = 0, []
    while done < steps:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical or N,
                                optimizer=optimizer) as chunks:
            for batch_ in chunks:
                optimizer.zero_grad()
                if sharded or len(batch_[0]):  # every rank, even on an empty shard (FSDP)
                    loss_fn(module, batch_).backward()
                optimizer.step()
                batches.append(len(batch_[0]))
                if not optimizer.link.last_step_skipped:
                    done += 1
                if done == steps:
                    break
    return {"params": full_parameters(model), "history": list(engine.accountant.history),
            "noise": torch.stack(noises), "epsilon": engine.get_epsilon(1e-5),
            "sum_dtypes": sorted(sum_dtypes), "bound": optimizer.max_grad_norm,
            "expected_batch_size": optimizer.expected_batch_size, "chunk_sizes": batches,
            "counts": counts}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def one_rank_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Private steps (`private_step`, the training loop's) of a sharded MLP on one rank, batch by
    batch of a Poisson loader with q = 1/40: each batch's size and the sizes of the chunks
    `forward_backward` was called with."""
    from dptrain.privacy.engine import PrivacyEngine
    from dptrain.privacy.step import private_step

    init_gloo(rank, world_size, port)
    model, data, loss_fn = mlp_problem()
    model = _shard(model, no_units)
    engine = PrivacyEngine(accountant="rdp", seed=SEED)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=1), noise_multiplier=1.0, max_grad_norm=1.0)
    steps: list[dict[str, Any]] = []
    for batch, _ in zip(loader, range(10)):
        passes: list[int] = []

        def forward_backward(chunk: Any) -> int:
            passes.append(len(chunk[0]))
            loss_fn(module, chunk).backward()
            return len(chunk[0])

        private_step(optimizer, batch, None, forward_backward)
        steps.append({"batch": len(batch[0]), "passes": passes})
    return {"steps": steps, "steps_taken": optimizer.steps_taken}


def scenarios_worker(rank: int, world_size: int, port: int,
                     scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every scenario (train_private's kwargs) on this rank, under one process group."""
    init_gloo(rank, world_size, port)
    return {name: train_private(sharded=True, **kwargs) for name, kwargs in scenarios.items()}


# ----------------------------------------------------------------------------- bad input
def errors_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Each refused use of a sharded model on this rank: the ConfigError it raised (None: none)."""
    from dptrain.distributed.fsdp import shard_model
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world_size, port)
    error_of = ddp_workers._error_of

    def make_private(model: nn.Module, **overrides: Any) -> Any:
        from dptrain.privacy.engine import PrivacyEngine

        _, data, _ = mlp_problem()
        kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      data_loader=DataLoader(data, batch_size=10), noise_multiplier=1.0,
                      max_grad_norm=1.0)
        return PrivacyEngine(accountant="rdp", seed=SEED).make_private(**{**kwargs, **overrides})

    def root_left_whole() -> Any:
        model = mlp_problem()[0]
        fully_shard(model[0])  # the root's last layer stays a plain (replicated) parameter
        return make_private(model)

    def padding_then_examples() -> str | None:
        """The PrivacyError of real examples run while a padding pass is pending (None: none)."""
        from dptrain.errors import PrivacyError

        module, _, _ = make_private(_shard(mlp_problem()[0], no_units))
        x, _ = mlp_problem()[1].tensors
        module(x[:0]).sum().backward()  # a padding pass, its placeholder row still captured
        try:
            module(x[:2])               # real examples before the step: refused on every rank
        except PrivacyError as error:
            return str(error)
        return None

    return {
        "padding_then_examples": padding_then_examples(),
        "root_left_whole": error_of(root_left_whole),
        "non_poisson": error_of(lambda: make_private(_shard(mlp_problem()[0], no_units),
                                                     poisson_sampling=False,
                                                     allow_non_poisson=True)),
        "user_level": error_of(lambda: make_private(_shard(mlp_problem()[0], no_units),
                                                    privacy_unit="user", user_ids=list(range(N)))),
        "missing_unit": error_of(lambda: shard_model(mlp_problem()[0], ["GPT2Block"])),
        "sharded_fine": error_of(lambda: make_private(_shard(mlp_problem()[0], first_layer))),
    }
