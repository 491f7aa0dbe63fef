"""I/O floor of a merge: read every input tensor once, write one output model, no arithmetic.

Usage: python benchmarks/io_floor.py OUT_DIR BASE_DIR AGENT_DIR...

Every tensor of every model is read with safetensors; the base's tensors are
written to OUT_DIR/model.safetensors. Peak memory is about one model, like a
merge that buffers its output shard.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    out, models = Path(argv[0]), [Path(m) for m in argv[1:]]
    handles = [[safe_open(str(f), "pt") for f in sorted(m.glob("*.safetensors"))] for m in models]
    output = {}
    for base_file, *agent_files in zip(*handles):
        for name in base_file.keys():
            output[name] = base_file.get_tensor(name)
            for handle in agent_files:
                handle.get_tensor(name)  # read and dropped
    out.mkdir(parents=True, exist_ok=True)
    save_file(output, str(out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1:])
