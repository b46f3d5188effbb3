"""`import deep_ep` gives pyep: with PYTHONPATH=bench/deepep, DeepEP's own tests run unmodified on pyep
(`from deep_ep import ...` and `deep_ep.X` alike). See bench/README.md, "DeepEP's own test on pyep"."""
import sys

import pyep

sys.modules[__name__] = pyep
