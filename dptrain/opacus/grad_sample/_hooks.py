"""What to use instead of Opacus's hook classes and per-sample bookkeeping helpers, which
dptrain's modules do not split out (shared by the grad_sample alias modules)."""

HOOKS = ("the module class itself (GradSampleModule, or GradSampleModuleFastGradientClipping "
         "for ghost clipping): dptrain's modules install and remove their own hooks "
         "(remove_hooks())")
BOOKKEEPING = ("GradSampleModule, which keeps each parameter's per-sample gradients in "
               "p.grad_sample (one tensor of all the passes' rows); register_grad_sampler for a "
               "layer of your own")
