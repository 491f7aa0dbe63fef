"""What a merge tells: `ram_stats.json` and the model card section, and what they are made from.

`report` (the statistics file's schema and the merge's record), `card` (the card's section: the reproduce line, the
`verify` command), `tables` (the per-agent tables a merge and `inspect` print), `labels` (inputs named the same on
every machine), `versions` (installed versions and where mergekit-ram came from) and `plot` (`inspect --plot`). They
may import `checks`, `core` and the shared top-level modules (`errors`, `files`, `session`); never the seam or
`verify` (`tests/test_layout.py`).
"""
