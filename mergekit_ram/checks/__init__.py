"""The checks a merge makes before it reads a weight: the config, the input models, the output folder.

`config_checks` (one base model, parameter names, places and ranges, device flags the machine can honour),
`input_checks` (files mergekit would fail on obscurely, tensors that cannot be merged as floats, stored dtypes),
`output_checks` (never into an input model; stale files removed, each named), `hub_cache` (a hub id read from the
Hub cache when the Hub cannot be asked) and `paths` (where a path that is not
there was looked for: a relative one in the working folder, and the config's; for the doors and `verify`). Each
refusal is one line naming the tensor, model or parameter. They may import `core` and the shared top-level modules
(`errors`, `files`); never the seam, `reporting` or `verify` (`tests/test_layout.py`).
"""
