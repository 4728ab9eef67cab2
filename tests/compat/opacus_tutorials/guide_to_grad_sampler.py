# Opacus tutorial tutorials/guide_to_grad_sampler.ipynb (github.com/pytorch/opacus, commit 4d0ebc8):
# its code cells in order ("# %%" starts a cell), with only the opacus imports
# changed to dptrain.opacus.
#
# Copyright (c) Meta Platforms, Inc. and affiliates.
# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this
# file except in compliance with the License. You may obtain a copy of the License at
#     http://www.apache.org/licenses/LICENSE-2.0
# Unless required by applicable law or agreed to in writing, software distributed under
# the License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY
# KIND, either express or implied. See the License for the specific language governing
# permissions and limitations under the License.

# %%
optimizer = torch.optim.SGD(lr=0.01)
for x, y i DataLoader(train_dataset, batch_size=128):
  # Run samples one-by-one to get per-sample gradients
  for x_i, y_i in zip(x, y):
    y_hat_i = model(x_i)
    loss = criterion(y_hat_i, y_i)
    loss.backward()
  
    # Clip each parameter's per-sample gradient
    for p in model.parameters():
      per_sample_grad = p.grad.detach().clone()
      torch.nn.utils.clip_grad_norm(per_sample_grad, max_norm=1.0)
      p.accumulated_grads.append(per_sample_grad)
    model.zero_grad(). # p.grad is accumulative, so we need to manually reset
  
  # Aggregate clipped gradients of all samples in a batch, and add DP noise
  for p in model.parameters():
    p.grad = accumulate_and_noise(p.accumulated_grads, dp_paramters)
  
  optimizer.step()
  optimizer.zero_grad()

# %%
import torch.nn as nn
from dptrain.opacus.grad_sample import GradSampleModule

lin_mod = nn.Linear(42,2)
print(f"Before wrapping: {lin_mod}")

gs_lin_mod = GradSampleModule(lin_mod)
print(f"After wrapping : {gs_lin_mod}")

# %%
def compute_linear_grad_sample(
    layer: nn.Linear, activations: torch.Tensor, backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """
    Computes per sample gradients for ``nn.Linear`` layer
    Args:
        layer: Layer
        activations: Activations
        backprops: Backpropagations
    """
    gs = torch.einsum("n...i,n...j->nij", backprops, activations)
    ret = {layer.weight: gs}
    if layer.bias is not None:
        ret[layer.bias] = torch.einsum("n...k->nk", backprops)

    return ret

# %%
from dptrain.opacus.grad_sample import register_grad_sampler


@register_grad_sampler(nn.Linear)
def compute_linear_grad_sample(
    layer: nn.Linear, activations: torch.Tensor, backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """
    Computes per sample gradients for ``nn.Linear`` layer
    Args:
        layer: Layer
        activations: Activations
        backprops: Backpropagations
    """
    gs = torch.einsum("n...i,n...j->nij", backprops, activations)
    ret = {layer.weight: gs}
    if layer.bias is not None:
        ret[layer.bias] = torch.einsum("n...k->nk", backprops)

    return ret

# %%
x_shape = [N, Z, W]
x = torch.randn(x_shape)
model = nn.Linear(W, W + 2)
assert check_per_sample_gradients_are_correct(
        x,
        model
    ) # This will fail only if the opacus per sample gradients do not match the micro-batch gradients.
