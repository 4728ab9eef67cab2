"""What replaces Opacus's PRV internals in dptrain (shared by this package's modules)."""

INSTEAD = ("dptrain.opacus.accountants.PRVAccountant (its history of (sigma, q, steps) and "
           "get_epsilon(delta)); dptrain's own discretisation of the privacy loss is in "
           "dptrain.accounting.prv")
