"""Opacus's ``opacus.grad_sample.grad_sample_module``."""

from dptrain.opacus._absent import absent
from dptrain.opacus.grad_sample import GradSampleModule
from dptrain.opacus.grad_sample._hooks import BOOKKEEPING, HOOKS

_HERE = "opacus.grad_sample.grad_sample_module"
GradSampleHooks = absent(f"{_HERE}.GradSampleHooks", HOOKS)
create_or_accumulate_grad_sample = absent(f"{_HERE}.create_or_accumulate_grad_sample", BOOKKEEPING)
promote_current_grad_sample = absent(f"{_HERE}.promote_current_grad_sample", BOOKKEEPING)

__all__ = ["GradSampleHooks", "GradSampleModule", "create_or_accumulate_grad_sample",
           "promote_current_grad_sample"]
