"""`v4parity synth` and `v4parity inspect`: make and examine deepseek4 GGUF files."""

from __future__ import annotations

import click

from parity.cli.common import echo_json, json_errors, json_option, model_option
from parity.gguf.lcp_layouts import FTYPES
from parity.gguf.synth import PRESETS, QUANTS
from parity.gguf.synth_draft import DRAFT_QUANTS


@click.command()
@click.option("--preset", type=click.Choice([*sorted(PRESETS), "flash"]), default="tiny", show_default=True,
              help="Model dimensions (tiny: 6 layers, every feature fires in ~300 tokens; flash: the real V4-Flash "
                   "shape at full depth, 43 layers, real vocabulary, release types, written streaming, ~10 GB with "
                   "16 experts).")
@click.option("--quant", type=click.Choice(QUANTS), default=None, metavar="[f32|real-mix|mxfp4|lcp-FTYPE]",
              help="f32: all F32; real-mix: the real release's per-class types; mxfp4: MXFP4 experts; "
                   "lcp-FTYPE: each tensor in the type llama.cpp's quantizer writes at that file type, FTYPE "
                   f"one of {', '.join(FTYPES)} (k-quants and IQ4 as random valid blocks).  [default: f32; "
                   "flash: real-mix, the only layout it writes]")
@click.option("--experts", type=click.IntRange(min=6), default=None,
              help="--preset flash: routed experts per layer (6 active, width 2048).  [default: 16]")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed (same seed -> same bytes).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="GGUF file to write.")
@click.option("--draft", type=click.Choice(["mtp", "dspark"]), default=None,
              help="Also write a tiny drafter for the model: the MTP block or a 3-stage DSpark drafter "
                   "(needs --draft-layout and --draft-out), e.g. v4parity synth -o tiny.gguf --draft mtp "
                   "--draft-layout llamacpp --draft-out tiny-mtp.gguf")
@click.option("--draft-layout", type=click.Choice(["ds4", "llamacpp", "dflash"]), default=None,
              help="Drafter file layout: MTP ds4 | llamacpp, DSpark ds4 (deepseek4-dspark) | dflash "
                   "(docs/drafters.md).")
@click.option("--draft-out", type=click.Path(dir_okay=False), default=None, help="Drafter GGUF file to write.")
@click.option("--draft-quant", type=click.Choice(DRAFT_QUANTS), default="f32", show_default=True,
              help="f32: all F32; q8_0: block and projection matrices Q8_0, the rest F32.")
@click.option("--fit", is_flag=True, help="Fit the drafter to the model's own greedy continuations (Adam through the "
              "torch engine's draft-head ops, seeded, CPU) and print its agreement with the trunk per slot, measured "
              "by the reference engine on the fitted and on held-out prompts (docs/drafters.md).")
@click.option("--fit-steps", type=click.IntRange(min=1), default=None,
              help="Adam steps of --fit  [default: 40 mtp, 100 dspark]")
@click.option("--fit-depth", type=click.IntRange(min=1), default=1, show_default=True,
              help="MTP --fit: also fit (and measure) the chained drafts d_2..d_DEPTH.")
@json_option()
@json_errors
def synth(preset: str, quant: str | None, experts: int | None, seed: int, output: str, draft: str | None,
          draft_layout: str | None, draft_out: str | None, draft_quant: str, fit: bool, fit_steps: int | None,
          fit_depth: int, as_json: bool) -> None:
    """Write a synthetic deepseek4 GGUF with the real key names, value types and tensor names.

    \b
    Example: v4parity synth --preset tiny --quant real-mix -o tiny.gguf
             v4parity synth --preset tiny --quant lcp-Q4_K_M -o tiny-q4_k_m.gguf
             v4parity synth --preset flash --experts 16 -o /tmp/flash.gguf
    """
    from parity.gguf.synth import synthesize

    if preset == "flash":
        _flash(quant, experts, seed, output, draft or draft_layout or draft_out or (fit and "--fit"), as_json)
        return
    if experts is not None:
        raise click.UsageError("--experts is for --preset flash only")
    quant = quant or "f32"
    layout = _draft_layout(draft, draft_layout, draft_out)
    if fit and layout is None:
        raise click.UsageError("--fit needs --draft, --draft-layout and --draft-out")
    path = synthesize(output, preset, quant, seed)
    size = path.stat().st_size
    if fit:
        _fit(path, size, draft, draft_out, layout, seed, fit_steps, fit_depth, draft_quant, as_json)
        return
    doc = {"wrote": str(path), "bytes": size, "preset": preset, "quant": quant, "seed": seed}
    drafter = None if layout is None else _drafter(draft_out, path, draft, layout, seed, draft_quant)
    if as_json:
        echo_json({**doc, "draft": drafter} if drafter else doc)
        return
    click.echo(f"wrote {path} ({size:,} bytes; preset={preset} quant={quant} seed={seed})")
    if drafter:
        click.echo(f"wrote {drafter['wrote']} ({drafter['bytes']:,} bytes; drafter {draft} layout={layout} "
                   f"quant={draft_quant})")


def _drafter(out: str, trunk, kind: str, layout: str, seed: int, quant: str) -> dict:
    """synth --draft: write the tiny drafter of `trunk` -> {wrote, bytes, kind, layout, quant}."""
    from parity.gguf.synth_draft import synthesize_drafter

    path = synthesize_drafter(out, trunk, kind, layout, seed, quant)
    return {"wrote": str(path), "bytes": path.stat().st_size, "kind": kind, "layout": layout, "quant": quant}


@click.command()
@model_option()
@click.option("--tensors", is_flag=True, help="Also list every tensor (name, shape, type, bytes).")
@click.option("--draft", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Inspect this drafter GGUF (MTP or DSpark, any layout) instead and validate it against the model: "
                   "head kind, layout, blocks, keys, tensors; exit 1 naming the problem on a bad pair. "
                   "e.g. v4parity inspect -m tiny.gguf --draft tiny-mtp.gguf")
@json_option(help="Print the whole report (tensors included) as JSON (errors too).")
@json_errors
def inspect(model: str, tensors: bool, draft: str | None, as_json: bool) -> None:
    """Show config (derived values marked), layer schedule, the tensor count, the type mix, which engines read
    it, the layout (llama.cpp quantizer types that differ from the release's) and the validation result.

    \b
    Exit codes: 0 valid, 1 the file does not satisfy the deepseek4 contract, 2 unreadable metadata.
    Example: v4parity inspect -m tiny.gguf --tensors
    """
    if draft is not None:
        from parity import api
        from parity.gguf.drafter_report import print_drafter_inspection

        report = api.inspect_drafter(model, draft)
        if as_json:
            echo_json(report)
        else:
            print_drafter_inspection(report, tensors=tensors)
        if not report["validation"]["ok"]:
            raise SystemExit(1)
        return
    from parity.gguf.report import inspect_model, print_inspection

    report = inspect_model(model)
    if as_json:
        echo_json(report)
    else:
        print_inspection(report, tensors=tensors)
    if not report["validation"]["ok"]:
        raise SystemExit(1)


def _flash(quant: str | None, experts: int | None, seed: int, output: str, drafting: object, as_json: bool) -> None:
    """synth --preset flash: the full-depth V4-Flash-shaped file, streaming, in the release type mix."""
    from parity.gguf.synth_flash import DEFAULT_EXPERTS, write_flash

    if quant not in (None, "real-mix"):
        raise click.UsageError(f"--preset flash is written in the release type mix only (--quant real-mix), "
                               f"not {quant}")
    if drafting:
        raise click.UsageError("--preset flash writes no drafter (--draft/--draft-layout/--draft-out/--fit)")
    experts = DEFAULT_EXPERTS if experts is None else experts
    path = write_flash(output, experts, seed)
    size = path.stat().st_size
    if as_json:
        echo_json({"wrote": str(path), "bytes": size, "preset": "flash", "quant": "real-mix", "experts": experts,
                   "seed": seed})
    else:
        click.echo(f"wrote {path} ({size:,} bytes; preset=flash quant=real-mix experts={experts} seed={seed})")


def _fit(path, size: int, kind: str, draft_out: str, layout: str, seed: int, steps: int | None, depth: int,
         quant: str, as_json: bool) -> None:
    """synth --fit: write the fitted drafter and print what it agrees with (per slot)."""
    from parity import api

    r = api.fit_drafter(path, draft_out, kind, layout=layout, seed=seed, steps=steps, depth=depth, quant=quant)
    names = {"fitted": "fitted_prompts", "heldout": "heldout_prompts", "random_fitted": "random_drafter_fitted_prompts",
             "random_heldout": "random_drafter_heldout_prompts"}
    if as_json:
        echo_json({"wrote": str(path), "bytes": size, "draft": {
            "wrote": str(r.path), "bytes": r.path.stat().st_size, "kind": kind, "layout": layout, "quant": quant,
            "fit": {"steps": r.steps, "seed": seed, "depth": depth, "agreement_per_slot": {names[k]: list(v) for k, v in
                                                                           r.agreement.items()},
                    "counted": list(r.counted), "seconds": r.seconds}}})
        return
    pct = lambda v: " ".join(f"{x:.1%}" for x in v)  # noqa: E731
    a = r.agreement
    click.echo(f"wrote {path} ({size:,} bytes)")
    click.echo(f"wrote {r.path} (fitted {kind} drafter layout={layout} quant={quant}; {r.steps} Adam steps, "
               f"seed {seed}{f', depth {depth}' if kind == 'mtp' else ''})")
    click.echo(f"agreement with the trunk's greedy tokens per slot (reference engine; {r.counted[0]} / "
               f"{r.counted[1]} drafted {'pairs' if kind == 'mtp' else 'rounds'}):")
    click.echo(f"  fitted drafter:  fitted prompts {pct(a['fitted'])}; held-out prompts {pct(a['heldout'])}")
    click.echo(f"  random drafter:  fitted prompts {pct(a['random_fitted'])}; held-out prompts "
               f"{pct(a['random_heldout'])}")
    click.echo("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items()))


def _draft_layout(draft: str | None, layout: str | None, out: str | None) -> str | None:
    """--draft / --draft-layout / --draft-out -> the drafter layout name (None: no drafter); all three or none."""
    if draft is None and layout is None and out is None:
        return None
    if draft is None or layout is None or out is None:
        raise click.UsageError("--draft, --draft-layout and --draft-out go together")
    name = {("mtp", "ds4"): "ds4-mtp", ("mtp", "llamacpp"): "llamacpp-mtp", ("dspark", "ds4"): "ds4-dspark",
            ("dspark", "dflash"): "dflash"}.get((draft, layout))
    if name is None:
        raise click.UsageError(f"--draft-layout {layout} is not a {draft} layout "
                               f"(mtp: ds4, llamacpp; dspark: ds4, dflash)")
    return name


COMMANDS = [synth, inspect]
