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
- `door`, `door_yaml`, `door_pytorch`: mergekit's two entry points as objects
  (`mergekit-yaml` and its kin, whose inputs are folders or hub ids;
  `mergekit-pytorch`, whose inputs are single files), so that each mode is
  written once over either;
- `planner`: a config planned by mergekit alone, as `run_merge` plans it;
- `raw_pytorch`: `mergekit-pytorch` (mergekit's `merge_raw_pytorch`): its planned tasks as a plan of ours;
- `pipeline`: the merge pipeline on mergekit's planned tasks (checks, count or
  cache, inject rho, report, write), for `mergekit-yaml`, `mergekit-pytorch` and
  `inspect` alike;
- `tasks`: mergekit's planned tasks as plain data (a `Plan` of either door), and
  rho written back into them;
- `counting`: the statistics pass on mergekit's executors, and its cache;
- `inspection`: `mergekit-ram inspect`, downhill: mergekit's own planning, then `pipeline`;
- `recompute`: verify's recompute interface (`verify/recompute.py`) on mergekit: a
  recorded merge planned again through its door, run on mergekit's executor
  comparing each tensor where it would be saved, or slice by slice through each
  tensor's own merge task for `verify --sample`; `comparing`: the tasks that
  compare where mergekit would save, and a published tensor's bytes read by range;
- `methods`: mergekit's own merge methods as verify sees them: which merge element by element (a sample may
  slice them), which draw random numbers;
- `options`: mergekit's merge options, declared for `inspect` and `verify` without importing
  mergekit (their help answers at once);
- `tokenizer_order`: a union tokenizer's added tokens numbered in one order in a `ramplus` merge;
- `hub_ids`: hub ids read from the Hub cache where mergekit would ask the Hub
  (offline, unreachable), in `ramplus` merges only;
- `loading`: linear-time tensor loading during `ramplus` merges and `inspect`
  (`LazyTensorLoader.get_tensor`, `LoadTensor._load_converted_tensor`).

Below the seam, modules take plain data and never import mergekit's private
modules (`tests/test_layout.py` checks it).
"""
