"""Opacus's ``opacus.schedulers``: noise and clipping-bound schedulers that change the DP
optimizer's noise_multiplier / max_grad_norm each time ``step()`` is called (usually per epoch).
The accountant records the noise multiplier each optimizer step actually used."""

from __future__ import annotations

from typing import Any, Callable

from dptrain.checks import check_max_grad_norm


class _Scheduler:
    """Sets `attribute` of the optimizer to value(epoch) on every step()."""

    attribute = "noise_multiplier"

    def __init__(self, optimizer: Any, *, last_epoch: int = -1) -> None:
        self.optimizer = optimizer
        self.base = float(getattr(optimizer, self.attribute))
        if self.attribute == "max_grad_norm" and not hasattr(optimizer.clipper, "_bound"):
            raise ValueError("a clipping-bound scheduler needs clipping='flat'.")
        self.last_epoch = last_epoch
        self.step()

    def value(self, epoch: int) -> float:
        raise NotImplementedError

    def _set(self, value: float) -> None:
        if self.attribute == "noise_multiplier":
            self.optimizer.noise_multiplier = value
        else:  # the flat clipper's bound (clipping and noise scale both follow it)
            self.optimizer.clipper._bound = check_max_grad_norm(value)

    def step(self) -> None:
        self.last_epoch += 1
        self._set(self.value(self.last_epoch))

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer" and not callable(v)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)


class ExponentialNoise(_Scheduler):
    """sigma_epoch = sigma_0 * gamma ** epoch."""

    def __init__(self, optimizer: Any, *, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def value(self, epoch: int) -> float:
        return self.base * self.gamma ** epoch


class LambdaNoise(_Scheduler):
    """sigma_epoch = sigma_0 * noise_lambda(epoch)."""

    def __init__(self, optimizer: Any, *, noise_lambda: Callable[[int], float],
                 last_epoch: int = -1) -> None:
        self.noise_lambda = noise_lambda
        super().__init__(optimizer, last_epoch=last_epoch)

    def value(self, epoch: int) -> float:
        return self.base * self.noise_lambda(epoch)


class StepNoise(_Scheduler):
    """sigma_epoch = sigma_0 * gamma ** (epoch // step_size)."""

    def __init__(self, optimizer: Any, *, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch=last_epoch)

    def value(self, epoch: int) -> float:
        return self.base * self.gamma ** (epoch // self.step_size)


class ExponentialGradClip(ExponentialNoise):
    attribute = "max_grad_norm"


class LambdaGradClip(LambdaNoise):
    """C_epoch = C_0 * scheduler_function(epoch) (Opacus's keyword for the clip scheduler)."""

    attribute = "max_grad_norm"

    def __init__(self, optimizer: Any, *, scheduler_function: Callable[[int], float],
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, noise_lambda=scheduler_function, last_epoch=last_epoch)


class StepGradClip(StepNoise):
    attribute = "max_grad_norm"


_NoiseScheduler = _GradClipScheduler = _Scheduler  # Opacus's base classes (one base here)

__all__ = ["ExponentialNoise", "LambdaNoise", "StepNoise", "ExponentialGradClip",
           "LambdaGradClip", "StepGradClip"]
