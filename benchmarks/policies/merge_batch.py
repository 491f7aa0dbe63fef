"""Many `mergekit-pytorch` merges in one process: mergekit's own command, called in-process once per merge.

    PYTHONHASHSEED=0 python benchmarks/policies/merge_batch.py jobs.json

`jobs.json`: a list of argument lists, each exactly what follows `mergekit-pytorch` on a command line (config, output
folder, options). Starting a process costs about 4 s (imports); merging two 93 KB actors, about 0.1 s: a seed's
60 merges take a few seconds here instead of four minutes. Each merge gives the bytes `mergekit-pytorch` gives with
the same arguments and the same PYTHONHASHSEED (tests/test_policies.py checks it for `dare_linear`): mergekit seeds
torch with `--random-seed` at the start of each merge, and DARE's masks also follow the order of the tensors, which
follows Python's string hashing: run.py fixes PYTHONHASHSEED for every merge.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch
    from mergekit.scripts.merge_raw_pytorch import main as mergekit_pytorch

    torch.set_num_threads(1)
    for args in json.loads(Path(argv[0]).read_text()):
        mergekit_pytorch.main(list(args), standalone_mode=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
