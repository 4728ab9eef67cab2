"""The training methods compared by the end-to-end benchmark: one optimisation step each.

Every method trains the same architecture at the same batch size with the same noise multiplier
sigma and clipping norm C (plain PyTorch ignores both), SGD with a fixed learning rate, and
batches of exactly B samples (fixed batches stand in for Poisson sampling: timing only).
A method builder returns a ``Step``: ``step(x, y)`` runs forward, backward and the update.
"""

import contextlib
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

Step = Callable[[torch.Tensor, torch.Tensor], None]

#: Methods in table order: baselines first, then dptrain's modes, then Opacus's.
METHODS = ("plain", "microbatch", "dptrain_hooks", "dptrain_ghost", "opacus_hooks", "opacus_ghost")
LEARNING_RATE = 0.05
#: Weight and compute precisions (``apply_precision``); fp32 is the default.
PRECISIONS = ("fp32", "bf16_weights", "bf16_autocast")


@dataclass(frozen=True)
class Privacy:
    """Privacy parameters shared by the DP methods: sigma and the clipping norm C."""

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0


class SequenceCrossEntropy(nn.Module):
    """Cross-entropy per sample: logits ``[B, K]`` or ``[B, T, K]`` -> loss ``[B]`` (mean over T).

    ``reduction`` is ``"mean"`` (a scalar, mean over samples) or ``"none"`` (``[B]``); Opacus's
    ghost-clipping criterion sets it to ``"none"``.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_token = F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none")
        per_sample = per_token.view(target.shape[0], -1).mean(dim=1)
        return per_sample if self.reduction == "none" else per_sample.mean()


class Autocast(nn.Module):
    """``model`` run under bf16 autocast, the logits back in float32: what the trainer does with
    ``hardware.precision=bf16`` (forward and loss under autocast, whose cross-entropy is taken
    in float32; fp32 weights; backward and update outside)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self.model(x).float()


@contextlib.contextmanager
def building_at(precision: str) -> Iterator[None]:
    """Models built inside are created in bfloat16 with ``bf16_weights`` (as ``from_pretrained``
    loads them with ``dtype=bfloat16``: no float32 copy is made, then freed, whose heap memory
    later steps would reuse unseen by the peak-memory meter); unchanged otherwise."""
    if precision != "bf16_weights":
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def apply_precision(precision: str, model: nn.Module, pool: list) -> tuple[nn.Module, list]:
    """``model`` and its batch ``pool`` at ``precision`` (one of :data:`PRECISIONS`): unchanged
    (``fp32``), weights and float inputs in bfloat16 (``bf16_weights``: ``model.dtype=bfloat16``),
    or fp32 weights under bf16 autocast (``bf16_autocast``: ``hardware.precision=bf16``)."""
    if precision == "bf16_weights":
        pool = [(x.to(torch.bfloat16) if x.is_floating_point() else x, y) for x, y in pool]
        return model.to(torch.bfloat16), pool
    if precision == "bf16_autocast":
        return Autocast(model), pool
    if precision != "fp32":
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return model, pool


def unavailable_reason(method: str) -> str | None:
    """Why ``method`` cannot run in this environment (a missing package or part), else None."""
    if method.startswith("opacus") and importlib.util.find_spec("opacus") is None:
        return "opacus is not installed (pip install opacus)"
    if method.startswith("dptrain"):
        for module in ("dptrain.privacy.engine", "dptrain.grad_sample.module"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not available yet"
    if method == "dptrain_ghost" and importlib.util.find_spec("dptrain.grad_sample.ghost") is None:
        return "dptrain.grad_sample.ghost is not available yet"
    return None


def build_step(method: str, model: nn.Module, pool: list, privacy: Privacy) -> Step:
    """The ``Step`` of ``method`` for ``model`` (already on its device); ``pool`` holds the batches."""
    builders: dict[str, Callable[[], Step]] = {
        "plain": lambda: _plain(model),
        "microbatch": lambda: _microbatch(model, privacy),
        "dptrain_hooks": lambda: _dptrain(model, pool, privacy, "hooks"),
        "dptrain_ghost": lambda: _dptrain(model, pool, privacy, "ghost"),
        "opacus_hooks": lambda: _opacus(model, pool, privacy, "hooks"),
        "opacus_ghost": lambda: _opacus(model, pool, privacy, "ghost"),
    }
    return builders[method]()


def adapt_model(method: str, model: nn.Module) -> nn.Module:
    """Give each method the recurrent layer it would use: torch's fused ``nn.LSTM`` without DP,
    Opacus's own ``DPLSTM`` for Opacus, dptrain's ``DPLSTM`` for dptrain (same weights)."""
    lstm = getattr(model, "lstm", None)
    if lstm is None or method.startswith("dptrain"):
        return model
    sizes = (lstm.input_size, lstm.hidden_size)
    if method.startswith("opacus"):
        from opacus.layers import DPLSTM as OpacusDPLSTM

        replacement: nn.Module = OpacusDPLSTM(*sizes, batch_first=True)
    else:
        replacement = nn.LSTM(*sizes, batch_first=True)
    replacement.load_state_dict(lstm.state_dict())
    model.lstm = replacement.to(next(lstm.parameters()).device)
    return model


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def _batch_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module) -> Step:
    """One forward/backward of the whole batch through ``model`` and one ``optimizer`` step."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def _plain(model: nn.Module) -> Step:
    """Non-private SGD."""
    return _batch_step(model, _sgd(model), SequenceCrossEntropy())


def _microbatch(model: nn.Module, privacy: Privacy) -> Step:
    """Naive DP-SGD: one forward/backward per sample, clip it, sum, add noise, average."""
    optimizer, loss_fn = _sgd(model), SequenceCrossEntropy()
    params = [p for p in model.parameters() if p.requires_grad]
    clip = privacy.max_grad_norm

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        sums = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x[i : i + 1]), y[i : i + 1]).backward()
            grads = [p.grad for p in params]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            factor = (clip / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_add_(sums, torch._foreach_mul(grads, factor))
        for p, total in zip(params, sums):
            noise = torch.randn_like(total) * (privacy.noise_multiplier * clip)
            p.grad = (total + noise) / x.shape[0]
        optimizer.step()

    return step


def _pool_loader(pool: list) -> DataLoader:
    """A loader over the pool's samples, only to satisfy make_private's signature (not iterated)."""
    x = torch.cat([b[0] for b in pool]).cpu()
    y = torch.cat([b[1] for b in pool]).cpu()
    return DataLoader(TensorDataset(x, y), batch_size=pool[0][0].shape[0])


def _dptrain(model: nn.Module, pool: list, privacy: Privacy, mode: str) -> Step:
    """dptrain's PrivacyEngine.make_private in per-sample gradient mode ``mode``."""
    from dptrain import PrivacyEngine

    private_model, optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=_sgd(model), data_loader=_pool_loader(pool),
        noise_multiplier=privacy.noise_multiplier, max_grad_norm=privacy.max_grad_norm,
        poisson_sampling=False, allow_non_poisson=True, grad_sample_mode=mode,
    )
    return _batch_step(private_model, optimizer, SequenceCrossEntropy())


def _opacus(model: nn.Module, pool: list, privacy: Privacy, mode: str) -> Step:
    """Opacus's PrivacyEngine.make_private: ``"hooks"`` (GradSampleModule) or ``"ghost"``
    (fast gradient clipping, two backward passes through its criterion wrapper)."""
    from opacus import PrivacyEngine as OpacusEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = OpacusEngine(accountant="rdp").make_private(
            module=model, optimizer=_sgd(model), data_loader=_pool_loader(pool),
            criterion=SequenceCrossEntropy(), noise_multiplier=privacy.noise_multiplier,
            max_grad_norm=privacy.max_grad_norm, poisson_sampling=False, grad_sample_mode=mode,
        )
    private_model, optimizer = made[0], made[1]
    loss_fn = made[2] if mode == "ghost" else SequenceCrossEntropy()
    return _batch_step(private_model, optimizer, loss_fn)
