"""The method's core on plain tensors and numbers: it knows nothing of mergekit.

`kernel` (Eqs. 1, 2, 6, 7: masks, counts and the merge, chunked and streaming), `torch_loops` (its torch loops: GPUs,
no C compiler), `native` and `_native.c` (the same loops fused in C for CPU tensors, built on first use by `build`),
`formulas` (ρ and λ on plain numbers), `params` (the parameters, their defaults and ranges), `statistics` (counts to
ρ, λ and the diagnostics), `cache` (the statistics cache on disk) and `cachedir` (where files live between runs). They
import only each other and the shared leaves `errors` and `files`: never the seam, `checks`, `reporting`, `verify` or
`session` (`tests/test_layout.py`).
"""
