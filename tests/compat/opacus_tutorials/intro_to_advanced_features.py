# Opacus tutorial tutorials/intro_to_advanced_features.ipynb (github.com/pytorch/opacus, commit 4d0ebc8):
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
import torch
from torch import nn
from torch.utils.data import TensorDataset, DataLoader

import warnings
warnings.simplefilter("ignore")

class SampleNet(nn.Module):
    
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 2)
    
    def forward(self, x):
        x = self.fc1(x)
        x = self.fc2(x)
        return x

DATASET = TensorDataset(torch.randn(100, 16), torch.randint(0,2, (100,)))

# %%
from IPython.display import Image
Image(filename='img/make_private.png')

# %%
from dptrain.opacus import PrivacyEngine

privacy_engine = PrivacyEngine()

model = SampleNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(DATASET, batch_size=10)

print(
    f"Before make_private(). "
    f"Model:{type(model)}, Optimizer:{type(optimizer)}, DataLoader:{type(data_loader)}"
)

model, optimizer, data_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=data_loader,
    max_grad_norm=1.0,
    noise_multiplier=1.0,
)

print("="*20)

print(
    f"After make_private(). "
    f"Model:{type(model)}, Optimizer:{type(optimizer)}, DataLoader:{type(data_loader)}"
)

# %%
model = SampleNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(DATASET, batch_size=10)

# %%
from dptrain.opacus import GradSampleModule

model = GradSampleModule(model)
model

# %%
# take a fake training step
y = model(torch.randn(10, 16))
y.sum().backward()

# inspect gradient values
grad = model.fc1.weight.grad
grad_sample = model.fc1.weight.grad_sample

print("grad.shape: ", grad.shape)
print("grad_sample.shape: ", grad_sample.shape)

grad_sample_aggregated = grad_sample.mean(dim=0)
print("Average grad_sample over 1st dimension. Equal to original: ", torch.allclose(grad, grad_sample_aggregated))

model.zero_grad()

# %%
from dptrain.opacus.privacy_engine import forbid_accumulation_hook

model.register_forward_pre_hook(forbid_accumulation_hook)

# first backward should work fine
model(torch.randn(10, 16)).sum().backward()
print("First backward successful")

# second should fail
model(torch.randn(10, 16)).sum().backward()

model.zero_grad()

# %%
from dptrain.opacus.data_loader import DPDataLoader

dp_data_loader = DPDataLoader.from_data_loader(data_loader, distributed=False)

print("Is dataset the same: ", dp_data_loader.dataset == data_loader.dataset)
print(f"DPDataLoader length: {len(dp_data_loader)}, original: {len(data_loader)}")
print("DPDataLoader sampler: ", dp_data_loader.batch_sampler)

data_loader = dp_data_loader

# %%
batch_sizes = []
for x,y in dp_data_loader:
    batch_sizes.append(len(x))

print("Batch sizes sampled:", batch_sizes)

# %%
from dptrain.opacus.optimizers import DPOptimizer

sample_rate = 1 / len(data_loader)
expected_batch_size = int(len(data_loader.dataset) * sample_rate)

optimizer = DPOptimizer(
    optimizer=optimizer,
    noise_multiplier=1.0,
    max_grad_norm=1.0,
    expected_batch_size=expected_batch_size,
)

# %%
from dptrain.opacus.accountants import RDPAccountant

accountant = RDPAccountant()
optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))

# %%
from IPython.display import Image
Image(filename='img/optimizer.png')

# %%
from dptrain.opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.distributions.laplace import Laplace

class LaplaceDPOptimizer(DPOptimizer):

    def add_noise(self):
        laplace = Laplace(loc=0, scale=self.noise_multiplier * self.max_grad_norm)
        for p in self.params:
            _check_processed_flag(p.summed_grad)

            noise = laplace.sample(p.summed_grad.shape)
            p.grad = p.summed_grad + noise

            _mark_as_processed(p.summed_grad)
