"""Opacus's ``opacus.accountants.analysis``: the formulas behind the accountants (rdp, gdp, prv)."""
