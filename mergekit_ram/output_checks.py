"""Checks of where a `ramplus` merge writes: never into an input model, and a config mergekit
can write into the model card."""

from __future__ import annotations

import os
from typing import Any


def check_output(config: Any, out_path: str) -> None:
    """Refuse an output folder that is, or is inside, an input model's folder."""
    out = os.path.realpath(out_path)
    for model in config.referenced_models():
        path = model.model.path
        if os.path.isdir(path):
            real = os.path.realpath(path)
            if out == real or out.startswith(real + os.sep):
                raise ValueError(
                    f"output folder {out_path} is inside the input model {model}; "
                    "the merge would overwrite it. Choose another output folder."
                )


def check_config_serialisable(config: Any) -> None:
    """mergekit writes `config.to_yaml()` into the card, after the weights, when it was given no YAML text.

    mergekit 0.1.5's `ModelReference` serialiser returns itself for a path holding a space or
    a double quote, which pydantic reports as "Circular reference detected" once the whole
    model is written (plain mergekit methods too). Say so before any weight is read.
    """
    try:
        config.to_yaml()
    except ValueError as error:
        odd = [str(m) for m in config.referenced_models() if " " in str(m) or '"' in str(m)]
        where = f"model path(s) {' and '.join(sorted(odd))}" if odd else "this configuration"
        raise ValueError(
            f"mergekit cannot write {where} into the model card ({error}; mergekit 0.1.5 fails on paths "
            "with a space or a double quote). Pass the YAML text as run_merge(..., config_source=TEXT) "
            "(mergekit-yaml does), turn the card off, or use a path without them."
        ) from error
