"""The seam to mergekit: the only code that knows mergekit's private insides.

mergekit 0.1.5 has no plugin discovery and no whole-model pre-pass, so this
subpackage hooks in from outside:

- `finder`: at interpreter start-up (torch- and mergekit-free), a meta-path
  finder runs `hooks` right after mergekit's own modules load;
- `surface`: every private mergekit name used here, and the one guard that
  checks them all before anything is patched;
- `hooks`: the wrapped mergekit functions (`MergePlanner._plan`,
  `MergePlanner.plan_to_disk`, `mergekit.merge.run_merge`,
  `mergekit.merge.generate_card`, and `mergekit-pytorch`'s `plan_flat_merge`),
  each a thin call into `pipeline`;
- `pipeline`: the merge pipeline on mergekit's planned tasks (checks, count or
  cache, inject rho, report, write), for `mergekit-yaml`, `mergekit-pytorch` and
  `inspect` alike;
- `tasks`: mergekit's planned tasks as plain data (a `Plan` of either door), and
  rho written back into them;
- `counting`: the statistics pass on mergekit's executors, and its cache;
- `inspection`: `mergekit-ram inspect`, downhill: mergekit's own planning, then `pipeline`;
- `options`: mergekit's merge options, declared for `inspect` and `verify` without importing
  mergekit (their help answers at once);
- `tokenizer_order`: a union tokenizer's added tokens numbered in one order in a `ramplus` merge;
- `loading`: linear-time tensor loading during `ramplus` merges and `inspect`
  (`LazyTensorLoader.get_tensor`, `LoadTensor._load_converted_tensor`).

Below the seam, modules take plain data and never import mergekit's private
modules (`tests/test_layout.py` checks it).
"""
