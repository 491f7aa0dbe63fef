"""I/O floor of a merge: read every input tensor once, write one output model, no arithmetic.

Usage: python benchmarks/io_floor.py OUT_DIR BASE_DIR AGENT_DIR...

Every tensor of every model is read with safetensors; the base's tensors are
written to OUT_DIR/model.safetensors. Peak memory is about one model, like a
merge that buffers its output shard.

safetensors (0.4 and later) hands out tensors backed by its memory map: a tensor
that is never touched is never read from storage. Each tensor is therefore
touched once per 4 KiB page (one byte summed per page), so every input byte
really comes from the page cache or the disk, at almost no arithmetic cost.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PAGE = 4096


def touch(tensor: torch.Tensor) -> int:
    """Read one byte of every page of the tensor's storage (faults it in from the mmap)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return int(flat[::PAGE].sum()) + int(flat[-1]) if flat.numel() else 0


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    out, models = Path(argv[0]), [Path(m) for m in argv[1:]]
    handles = [[safe_open(str(f), "pt") for f in sorted(m.glob("*.safetensors"))] for m in models]
    output = {}
    for base_file, *agent_files in zip(*handles):
        for name in base_file.keys():
            output[name] = base_file.get_tensor(name)
            touch(output[name])
            for handle in agent_files:
                touch(handle.get_tensor(name))  # read and dropped
    out.mkdir(parents=True, exist_ok=True)
    save_file(output, str(out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1:])
