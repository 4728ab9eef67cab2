"""Opacus 1.6's public module paths, names and signatures on top of dptrain (an adapter only).

A migrating user changes ``opacus`` to ``dptrain.opacus`` in the imports; the calls keep their
Opacus shape and run on dptrain's engine. Where dptrain is stricter (a shuffled loader cannot be
charged as Poisson, noise comes from OS entropy), the call still runs, does the honest thing and
warns what changed; docs/migrating-from-opacus.md lists every difference. The core packages never
import this one (tests/test_import_graph.py).
"""

from dptrain.opacus import utils
from dptrain.opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from dptrain.opacus.privacy_engine import PrivacyEngine
from dptrain.opacus.version import __version__

__all__ = ["GradSampleModule", "GradSampleModuleFastGradientClipping", "PrivacyEngine", "utils",
           "__version__"]
