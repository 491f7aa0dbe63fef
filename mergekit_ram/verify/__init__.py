"""verify's own modules: a finished merge's folder judged against what its record makes.

- `driver`: `mergekit-ram verify`'s spine, from the folder's record to the verdict;
- `recompute`: the interfaces the driver is written against: what verify needs of mergekit (the seam's
  `_mergekit/recompute.py` implements it and the CLI passes it in), and what a method records beyond the weights
  (`MethodChecks`);
- `ramplus`: what verify checks of a `ramplus` merge beyond its weights (its statistics, rho and lambda, the counts
  against a sample's slices, the card's RAM+ section), plugged in as `ramplus.CHECKS`;
- `any_method`: what verify checks beyond the weights of a merge by one of mergekit's own methods, which records
  only its `mergekit_config.yml` and its card (`any_method.CHECKS`);
- `other_files`: the folder's files beside the weights (config, card, tokenizer, code, adapters);
- `bitwise`, `record_checks`, `published_checks`, `verdict`: the judging, on plain data;
- `folder_checks`, `loader_files`: a stranger's folder read safely, and which files each loader reads;
- `input_copies`: the user's copies of recorded inputs;
- `sample`: `--sample`'s draw and what passing it says; `ranged`: its bytes read by HTTP ranges;
- `hub`: a merge, or an input, on the Hugging Face Hub; `history`: which commit of an unpinned Hub input a
  published merge was made from (its candidates up to the merge's publication, and the search among them).

They may import `checks`, `reporting`, `core` and the shared top-level modules (`errors`, `files`, `session`);
never the seam. No merge code imports them: only the CLI, the doors (which read a record) and the seam's
`recompute` do (`tests/test_layout.py`).
"""
