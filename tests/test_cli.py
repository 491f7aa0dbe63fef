"""`mergekit-ram inspect CONFIG [--json F] [--plot F.png]`: the pre-pass alone.

In-process through `mergekit_ram.cli.main` (capsys) on the planted index sets
(closed-form counts), once as the installed console script.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
from helpers import closed_form, config_text, rows_by_model, strict_json, validate_schema

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_config(tmp_path: Path, text: str, name: str = "config.yml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def inspect(capsys, *args) -> tuple:
    from mergekit_ram import cli

    capsys.readouterr()
    code = cli.main(["inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict:
    """agent label -> cells of the printed table (columns are separated by 2+ spaces)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("agent "))
    rows = {}
    for line in lines[head + 2 :]:
        if not line.strip() or line.startswith("base:"):
            break
        cells = [c for c in line.split("  ") if c.strip()]
        rows[cells[0].strip()] = [c.strip() for c in cells[1:]]
    return lines[head], rows


def check_rows(rows: dict, totals: dict, lam) -> None:
    assert set(rows) == set(totals)
    for agent, want in totals.items():
        active, density, unique, one, many, rho, lam_cell = rows[agent]
        assert active == f"{want['active']:,}"
        assert density == f"{100 * want['density']:.2f}%"
        assert unique == f"{100 * want['unique'] / want['active']:.1f}%"
        assert one == f"{100 * want['shared_with_1'] / want['active']:.1f}%"
        assert many == f"{100 * want['shared_with_2plus'] / want['active']:.1f}%"
        assert rho == ("inf" if math.isinf(want["rho"]) else f"{want['rho']:.4g}")
        assert lam_cell == f"{lam(want['rho']):.4f}", agent


# ---------------------------------------------------------------- the report


def test_inspect_table_json_and_plot(merged, qwen_bf16, tmp_path, capsys):
    text = config_text(qwen_bf16, "ABC")
    cfg = write_config(tmp_path, text)
    js, png = tmp_path / "stats.json", tmp_path / "plot.png"
    code, out, err = inspect(capsys, cfg, "--json", js, "--plot", png)
    assert code == 0, err
    _, totals = closed_form(qwen_bf16.family, "ABC")
    head, rows = table_rows(out)
    assert "lambda (r=0.1, alpha=2)" in head
    check_rows(rows, totals, lambda rho: 1 + 0.1 * min(rho, 2.0))
    assert "(computed; rho per model)" in out
    numel = sum(t.numel() for t in qwen_bf16.family.base.values())
    assert f"base: base ({qwen_bf16.path('base')}); {numel:,} parameters" in out
    assert f"agents: {', '.join(f'{a} ({qwen_bf16.path(a)})' for a in 'ABC')}" in out  # each path once, by its label
    assert "warning" not in err

    # JSON: the ram_stats.json of a real merge of the same config
    report = strict_json(js.read_text(encoding="utf-8"))
    validate_schema(report)
    merge_report = strict_json((merged(text).out / "ram_stats.json").read_text(encoding="utf-8"))
    assert report == merge_report

    # diagnostics: per agent and per pair, as in the JSON
    printed = out.split("Diagnostics", 1)[1]
    for row in report["agents"]:
        want = [row["label"], f"{100 * row['magnitude_unique_share']:.2f}%", f"{100 * row['single_step_share']:.2f}%"]
        assert want in [line.split() for line in printed.splitlines()], (want, printed)
    for pair in report["pairs"]:
        a, b = pair["agents"]
        line = next(x for x in printed.splitlines() if x.startswith(f"{a} / {b} "))
        assert line.split()[3:] == [f"{pair['common']:,}", f"{100 * pair['same_sign_share']:.2f}%", f"{pair['cosine']:.4f}"]

    # PNG: valid, decodable, not a blank postage stamp
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.shape[0] >= 150 and image.shape[1] >= 300
    assert float(image[..., :3].std()) > 0.05  # heat maps, not a flat picture


@pytest.mark.quick
def test_inspect_other_r_alpha_and_rule(qwen_bf16, tmp_path, capsys):
    cfg = write_config(tmp_path, config_text(qwen_bf16, "ABC"))
    _, totals = closed_form(qwen_bf16.family, "ABC")
    js = tmp_path / "s.json"
    code, out, err = inspect(capsys, cfg, "--r", "0.2", "--alpha", "1", "--json", js)
    assert code == 0, err
    head, rows = table_rows(out)
    assert "lambda (r=0.2, alpha=1)" in head
    check_rows(rows, totals, lambda rho: 1 + 0.2 * min(rho, 1.0))
    report = json.loads(js.read_text())
    assert report["parameters"]["r"] == 0.2 and report["parameters"]["alpha"] == 1
    for row in report["agents"]:
        assert row["lambda"] == pytest.approx(1 + 0.2 * min(totals[row["label"]]["rho"], 1.0))
    # A's rho (1.44) is below the paper's alpha but above 1: the clip shows
    assert totals["A"]["rho"] > 1 and rows["A"][-1] == "1.2000"

    code, out, err = inspect(capsys, cfg, "--r", "0.3", "--lambda-rule", "soft")
    assert code == 0, err
    head, rows = table_rows(out)
    assert "lambda (soft, r=0.3)" in head
    check_rows(rows, totals, lambda rho: 1 + 0.3 * (1 if math.isinf(rho) else rho / (1 + rho)))


def test_inspect_then_merge_reads_weights_once(run_yaml, qwen_bf16, tmp_path, capsys, monkeypatch, tensor_reads):
    monkeypatch.setenv("MERGEKIT_RAM_CACHE", str(tmp_path / "cache"))
    text = config_text(qwen_bf16, "ABC")
    cfg = write_config(tmp_path, text)
    code, out, err = inspect(capsys, cfg)
    assert code == 0, err
    assert "(computed;" in out
    assert set(tensor_reads.values()) == {1}  # inspect reads each tensor once, to count it

    code, out, err = inspect(capsys, cfg)
    assert code == 0 and "(cache;" in out

    tensor_reads.clear()
    run = run_yaml(text)
    assert run.count_calls == 0, "the merge counted again after inspect"
    assert set(tensor_reads.values()) == {1} and len(tensor_reads) == 4 * len(qwen_bf16.family.base)
    assert json.loads((run.out / "ram_stats.json").read_text())["statistics"] == "cache"


# ---------------------------------------------------------------- warnings and errors


def test_dense_agent_warns_on_stderr(qwen_bf16, tmp_path, capsys):
    fam = qwen_bf16.family
    dense = {k: (v.double() + 0.03).to(v.dtype) for k, v in fam.base.items()}
    path = models.write_checkpoint(tmp_path / "SFT", models.make_config("qwen2", False, torch.bfloat16), dense).resolve()
    text = config_text(qwen_bf16, "A").replace("models:\n", f"models:\n  - model: {path}\n", 1)
    cfg = write_config(tmp_path, text)
    js = tmp_path / "s.json"
    code, out, err = inspect(capsys, cfg, "--json", js)
    assert code == 0, err
    density = rows_by_model(json.loads(js.read_text()))[str(path)]["density"]
    assert density > 0.9
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert warnings[0].startswith(f"warning: SFT changes {100 * density:.1f}% of the weights")
    assert "SFT" in table_rows(out)[1]


def test_no_base_model_exits_2_with_one_line(qwen_bf16, tmp_path, capsys):
    text = "merge_method: ramplus\ndtype: bfloat16\nmodels:\n" + "".join(
        f"  - model: {qwen_bf16.path(a)}\n" for a in ("base", "A", "B")
    )
    code, out, err = inspect(capsys, write_config(tmp_path, text))
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mergekit-ram inspect: error:") and "base_model" in lines[0]


def _shape_mismatch(qwen, root: Path) -> Path:
    sd = dict(qwen.family.agents["B"])
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:16].clone()
    return models.write_checkpoint(root / "SHAPE", models.make_config("qwen2", False, torch.bfloat16), sd).resolve()


def _truncated(qwen, root: Path) -> Path:
    sd = dict(qwen.family.agents["B"])
    path = models.write_checkpoint(root / "TRUNCATED", models.make_config("qwen2", False, torch.bfloat16), sd).resolve()
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


@pytest.mark.parametrize(
    "bad, named",
    [
        (lambda qwen, root: Path(qwen.path("NAN")), "model.layers.1.mlp.down_proj.weight"),
        (_shape_mismatch, "model.layers.0.mlp.up_proj.weight"),
        (_truncated, "model.safetensors"),
    ],
    ids=["nan", "shape", "truncated-file"],
)
def test_an_input_that_cannot_be_counted_exits_1_with_one_line(qwen_bf16, tmp_path, capsys, bad, named):
    """A data error (the inputs, not the command) is exit code 1; usage errors stay 2 (below)."""
    path = bad(qwen_bf16, tmp_path)
    text = config_text(qwen_bf16, "A").replace("models:\n", f"models:\n  - model: {path}\n", 1)
    code, out, err = inspect(capsys, write_config(tmp_path, text), "-q")
    assert code == 1, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mergekit-ram inspect: error:") and named in lines[0] and str(path) in lines[0]


@pytest.mark.quick
def test_missing_config_file_exits_2(tmp_path, capsys):
    code, out, err = inspect(capsys, tmp_path / "nope.yml")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"mergekit-ram inspect: error: no such config file: {tmp_path / 'nope.yml'}"]


def test_non_ramplus_config_is_inspected(qwen_bf16, tmp_path, capsys):
    text = config_text(
        qwen_bf16, "ABC", method="task_arithmetic", model_parameters={a: "weight: 1.0" for a in "ABC"}
    )
    js = tmp_path / "s.json"
    code, out, err = inspect(capsys, write_config(tmp_path, text), "--json", js)
    assert code == 0, err
    _, totals = closed_form(qwen_bf16.family, "ABC")
    check_rows(table_rows(out)[1], totals, lambda rho: 1 + 0.1 * min(rho, 2.0))
    report = json.loads(js.read_text())
    assert report["method"] == "ramplus"
    assert {m: a["active"] for m, a in rows_by_model(report).items()} == {
        qwen_bf16.path(a): totals[a]["active"] for a in "ABC"
    }


@pytest.mark.quick
@pytest.mark.parametrize("flag, value", [("--r", "-1"), ("--alpha", "inf"), ("--r", "nan")])
def test_invalid_r_or_alpha_exits_2(qwen_bf16, tmp_path, capsys, flag, value):
    code, out, err = inspect(capsys, write_config(tmp_path, config_text(qwen_bf16, "AB")), flag, value, "-q")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mergekit-ram inspect: error: {flag} must be a finite number >= 0")


def test_invalid_r_is_rejected_before_reading_weights(qwen_bf16, tmp_path, capsys, monkeypatch):
    from mergekit_ram.core import kernel

    def refuse(*_a, **_k):
        raise AssertionError("counted tensors before validating --r")

    monkeypatch.setattr(kernel, "count", refuse)
    monkeypatch.setattr(kernel, "diagnose", refuse)
    code, _, err = inspect(capsys, write_config(tmp_path, config_text(qwen_bf16, "AB")), "--r", "-1")
    assert code == 2 and "--r must be" in err


# ---------------------------------------------------------------- console script


@pytest.mark.real_process  # the installed script, started as a user starts it
def test_console_script(qwen_bf16, tmp_path, capsys):
    exe = Path(sys.executable).parent / "mergekit-ram"
    if not exe.exists():
        pytest.skip("the mergekit-ram console script is not installed next to this interpreter")
    cfg = write_config(tmp_path, config_text(qwen_bf16, "AB"))
    env = {**os.environ, "MERGEKIT_RAM_CACHE": "off", "MERGEKIT_RAM_NATIVE": "0"}  # no kernel build on the way
    done = subprocess.run(
        [str(exe), "inspect", cfg, "--json", str(tmp_path / "cli.json"), "-q"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _, totals = closed_form(qwen_bf16.family, "AB")
    check_rows(table_rows(done.stdout)[1], totals, lambda rho: 1 + 0.1 * min(rho, 2.0))
    code, _, err = inspect(capsys, cfg, "--json", tmp_path / "inproc.json")
    assert code == 0, err
    assert json.loads((tmp_path / "cli.json").read_text()) == json.loads((tmp_path / "inproc.json").read_text())


# ---------------------------------------------------------------- a stranger's first hour (issue 31)


@pytest.mark.quick
def test_plot_without_matplotlib_fails_before_any_work(qwen_bf16, tmp_path, capsys, monkeypatch):
    """It ran the whole statistics pass and wrote --json before failing, with a hint unlike the README's."""
    from mergekit_ram.core import kernel
    from mergekit_ram.reporting import plot

    def refuse(*_a, **_k):
        raise AssertionError("counted tensors before checking --plot")

    monkeypatch.setattr(kernel, "count", refuse)
    monkeypatch.setattr(kernel, "diagnose", refuse)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    js = tmp_path / "stats.json"
    code, out, err = inspect(capsys, write_config(tmp_path, config_text(qwen_bf16, "AB")), "--json", js, "--plot",
                             tmp_path / "p.png")  # fmt: skip
    assert code == 2 and err.strip() == f"mergekit-ram inspect: error: {plot.NEEDS}" and not js.exists()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    for command in ("pip install matplotlib", 'pip install ".[plot]"'):
        assert command in plot.NEEDS and command in readme, command


def test_quiet_inspect_of_a_flat_config_draws_no_bar(flat_mlp, tmp_path, capsys):
    """mergekit-pytorch's planner drew "Preparing model loaders" and "Planning operations" despite -q."""
    from helpers import flat_config_text

    cfg = write_config(tmp_path, flat_config_text(flat_mlp, ("A", "B", "C")))
    code, out, err = inspect(capsys, cfg, "-q")
    assert code == 0 and "RAM+ statistics of" in out
    assert "it/s" not in err and "Planning operations" not in err and "Preparing model loaders" not in err, err
    code, _, err = inspect(capsys, cfg)  # without -q, mergekit's bars are there: the test can see them
    assert code == 0 and "Planning operations" in err


@pytest.mark.quick
def test_verify_takes_mergekits_merge_options_but_the_recorded_and_the_writing_ones(monkeypatch):
    """verify's device flags are mergekit's own (as inspect's), less the options its folder's record fixes and those
    of writing a folder: `--gpu-rich`, which its errors name, is one of them; `-q` is `--quiet`, listed once."""
    from mergekit.options import MergeOptions

    from mergekit_ram._mergekit.options import WRITES
    from mergekit_ram.cli import common
    from mergekit_ram.cli import verify as verify_command
    from mergekit_ram.reporting.report import RECORDED_OPTIONS

    command = verify_command.command()
    names = {p.name for p in command.params}
    taken = set(MergeOptions.model_fields) - set(RECORDED_OPTIONS) - set(WRITES) | {"random_seed"}
    assert taken <= names and not (set(MergeOptions.model_fields) - taken) & names
    assert {"gpu_rich", "device", "cuda", "num_threads", "read_to_gpu", "multi_gpu", "low_cpu_memory"} <= taken
    assert {"target", "as_json", "inputs", "inputs_from", "input_dir", "trust"} <= names
    quiet = [p for p in command.params if "-q" in p.opts or "--quiet" in p.opts]
    assert len(quiet) == 1 and set(quiet[0].opts) == {"-q", "--quiet"}, [p.opts for p in quiet]
    from mergekit_ram.errors import NotVerifiable
    from mergekit_ram.verify import driver

    seen = {}

    def verify(folder, options, recomputing, **_kwargs):
        seen.update(options=options)
        raise NotVerifiable("stop here")

    monkeypatch.setattr(driver, "verify", verify)
    with pytest.raises(common.UsageError):
        command.main(["/nowhere", "--gpu-rich", "-q", "-j", "3"], standalone_mode=False)
    options = seen["options"]
    assert isinstance(options, MergeOptions)
    assert options.gpu_rich and options.num_threads == 3 and options.quiet and not options.trust_remote_code
    from mergekit_ram.verify import verdict

    # the exit codes' one home names verify's three as its verdict does (which imports torch)
    assert verdict.EXIT == {
        "identical": common.EXIT_OK,
        "differs": common.EXIT_NOT_IDENTICAL,
        "cannot check": common.EXIT_CANNOT_CHECK,
        verdict.LAST_BITS: common.EXIT_CANNOT_CHECK,
        verdict.ACCEPTED: common.EXIT_OK,
        verdict.MACHINE: common.EXIT_CANNOT_CHECK,
    }


@pytest.mark.quick
def test_verify_help_lists_what_changes_verify_grouped(capsys, monkeypatch):
    """Issue 61: `verify --help` listed mergekit's `--lora-merge-cache` (where merged LoRAs are written) beside the
    options that change what verify recomputes, in one list of 61 lines. Now its options come under four headings,
    each once; `--lora-merge-cache` is accepted but not listed; `--transformers-cache` says what verify reads there."""
    import re

    from mergekit_ram import cli
    from mergekit_ram.errors import NotVerifiable
    from mergekit_ram.verify import driver

    assert cli.main(["verify", "--help"]) == 0
    text = capsys.readouterr().out
    headings = [line for line in text.splitlines() if re.fullmatch(r"[A-Z][a-z ]+:", line)]
    assert headings == ["What it checks:", "Where the inputs are:", "How it recomputes:", "What it prints:"]
    sections = dict(zip(headings, re.split(r"\n(?:" + "|".join(headings) + r")\n", text)[1:]))
    flags = {h: re.findall(r"^  (-\w, --[-\w]+|-[-\w]+)", body, re.M) for h, body in sections.items()}
    assert flags == {
        "What it checks:": ["--sample", "--sample-seed", "--random-seed", "--accept-last-bits", "--trust-remote-code"],
        "Where the inputs are:": ["--input", "--inputs-from", "--input-dir", "--transformers-cache"],
        "How it recomputes:": ["--cuda", "--device", "--low-cpu-memory", "--read-to-gpu", "--multi-gpu",
                               "-j, --num-threads", "--gpu-rich"],
        "What it prints:": ["--json", "-q, --quiet", "-v", "--help"],
    }  # fmt: skip
    assert "lora" not in text.lower() and "Hub cache hub ids are read from" in text
    flat = " ".join(text.split())  # what the help says, however click wraps it
    for said in (
        "the statistics cache is never evidence, verify never reads it",  # docs/verify.md: not the statistics cache
        "is evidence of how it was merged, never applied without this flag",  # record_checks.recorded_options
        "the same seed draws the same slices on every machine",  # docs/verify.md: the draw
        "the verdict and --json always print it",
    ):
        assert said in flat, said
    seen = {}

    def verify(folder, options, recomputing, **_kwargs):
        seen.update(options=options)
        raise NotVerifiable("stop here")

    monkeypatch.setattr(driver, "verify", verify)
    assert cli.main(["verify", "/nowhere", "--lora-merge-cache", "/tmp/lora", "-q"]) == 2  # accepted, silently
    assert seen["options"].lora_merge_cache == "/tmp/lora"
    assert capsys.readouterr().err == "mergekit-ram verify: error: stop here\n"


@pytest.mark.quick
def test_merge_options_are_declared_as_mergekit_declares_them():
    """inspect and verify declare mergekit's merge options without importing mergekit (so that their help answers
    at once): each as mergekit's `add_merge_options` makes it (`-q` added to `--quiet`), and every field of
    `MergeOptions` either offered or one of those of writing a model (`WRITES`)."""
    from mergekit.options import MergeOptions, add_merge_options

    from mergekit_ram._mergekit import options

    theirs = {p.name: p for p in add_merge_options(lambda **_: None).__click_params__}
    ours = {p.name: p for p in options.declare()(lambda **_: None).__click_params__}
    assert list(ours) == [name for name in theirs if name in options.FIELDS]  # in mergekit's order
    assert set(ours) | set(options.WRITES) == set(theirs) == set(MergeOptions.model_fields)
    assert not set(ours) & set(options.WRITES)
    for name, mine in ours.items():
        given = theirs[name]
        assert set(mine.opts) - ({"-q"} if name == "quiet" else set()) == set(given.opts), name
        assert mine.secondary_opts == given.secondary_opts, name
        for attribute in ("type", "default", "help", "show_default", "count", "is_flag", "multiple", "required"):
            assert getattr(mine, attribute) == getattr(given, attribute), (name, attribute)
        assert MergeOptions.model_fields[name].default == mine.default, name


HEAVY = ("torch", "mergekit", "transformers")


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["example", "--help"],
        ["inspect", "--help"],
        ["verify", "--help"],
        ["inspect"],
        ["inspect", "CONFIG", "--no-such-flag"],
        ["inspect", "CONFIG", "--r", "-1"],
        ["inspect", "NOWHERE/config.yml"],
        ["inspect", "CONFIG", "--out-shard-size", "1B"],
        ["verify"],
        ["verify", "NOWHERE", "--input", "no-equals-sign"],
        ["verify", "NOWHERE", "--inputs-from", "no-equals-sign"],
        ["verify", "NOWHERE", "--input-dir", "NOWHERE/copies"],
        ["verify", "NOWHERE", "--no-such-flag"],
    ],
    ids=lambda args: " ".join(args),
)
@pytest.mark.quick
def test_help_version_and_usage_errors_import_no_torch_or_mergekit(tmp_path, args):
    """They imported mergekit, torch and transformers before answering: 4 s on a quiet machine (11 s at load 3,
    41-47 s under heavy load) against 0.07 s for `mergekit-ram --help`. Checked in a fresh interpreter."""
    config = tmp_path / "config.yml"
    config.write_text("merge_method: ramplus\n", encoding="utf-8")
    args = [a.replace("NOWHERE", str(tmp_path / "nowhere")).replace("CONFIG", str(config)) for a in args]
    code = (
        "import json, sys\n"
        "from mergekit_ram import cli\n"
        f"code = cli.main({args!r})\n"
        f"print('LOADED', json.dumps([m for m in {HEAVY!r} if m in sys.modules]), code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert "LOADED" in done.stdout, done.stderr[-3000:]
    loaded, code = done.stdout.split("LOADED ", 1)[1].rsplit(" ", 1)
    assert json.loads(loaded) == [], f"{' '.join(args)} imported {loaded}"
    assert int(code) == (0 if "--help" in args or "--version" in args else 2), done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    if int(code) and not lines[-1].startswith("Error: "):  # ours: one line (click's: its usage, a hint, the error)
        assert len(lines) == 1 and lines[0].startswith(f"mergekit-ram {args[0]}: error: "), lines


def _version(tmp_path, **env) -> list[str]:
    """`mergekit-ram --version` in a fresh interpreter, its cache folder in tmp_path; its lines."""
    base = {k: v for k, v in os.environ.items() if k not in ("CC", "MERGEKIT_RAM_NATIVE")}
    base.update(MERGEKIT_RAM_CACHE=str(tmp_path / "cache"), **env)
    done = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom mergekit_ram import cli\nsys.exit(cli.main(['--version']))"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=base,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


@pytest.mark.quick
def test_version_says_whether_the_fused_kernel_is_in_use(tmp_path):
    """Issue 53: `--version` says what runs: the kernel built, to be built on first use (nothing is built to say
    so), switched off, or not buildable and why; the torch kernel's results are the same, only slower."""
    from helpers import HAS_COMPILER

    from mergekit_ram.core import native

    first = _version(tmp_path)
    assert first[0].startswith("mergekit-ram ") and first[1].startswith("fused CPU kernel: ")
    if HAS_COMPILER:
        assert first[1].endswith(f"will be built on first use with {native.find_compiler()}"), first
        assert not (tmp_path / "cache" / "native").exists(), "--version built the kernel"
    assert _version(tmp_path, MERGEKIT_RAM_NATIVE="0")[1] == (
        "fused CPU kernel: off (MERGEKIT_RAM_NATIVE=0): the torch kernel runs, the same results, slower"
    )
    empty = tmp_path / "bin"
    empty.mkdir()
    (none,) = [line for line in _version(tmp_path, PATH=str(empty)) if "kernel" in line]
    assert none.startswith("fused CPU kernel: cannot be built: no C compiler found ($CC unset, no cc or gcc on PATH)")
    assert none.endswith("the torch kernel runs, the same results, slower"), none
    (broken,) = [line for line in _version(tmp_path, CC="/bin/false") if "kernel" in line]
    assert "cannot be built: no C compiler found (`/bin/false --version` exited with 1)" in broken, broken
    if HAS_COMPILER:
        env = {k: v for k, v in os.environ.items() if k not in ("CC", "MERGEKIT_RAM_NATIVE")}
        env["MERGEKIT_RAM_CACHE"] = str(tmp_path / "cache")
        built = subprocess.run(
            [sys.executable, "-c", "from mergekit_ram.core import native; print(native.target() if native.library() "
             "else 'not built')"], capture_output=True, text=True, timeout=600, env=env,
        ).stdout.strip()
        assert _version(tmp_path)[1] == f"fused CPU kernel: built ({built}), used on CPU tensors"
