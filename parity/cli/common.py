"""Options every command spells the same way, and the one place a `--json` command reports its errors.

Use these instead of declaring `--model`, `--device`, `--dtype`, `--inject`, `--json`, `--markdown` or
`--html` in a command, so the choices and the help text stay identical across the CLI.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from parity.contract.errors import ParityError
from parity.contract.files import atomic_write_text
from parity.contract.workpool import LOCAL_RAY_CPUS

DTYPES = ("float32", "float64", "bfloat16")
DEVICES = ("auto", "cuda", "cpu")


def model_option(required: bool = True, help: str = "deepseek4 GGUF file.") -> Callable:
    return click.option("-m", "--model", required=required, type=click.Path(exists=True, dir_okay=False), help=help)


def dtype_option(default: str = "float32", help: str = "") -> Callable:
    text = help or "float32; float64: the reference's oracle mode; bfloat16: the torch engine's approximate path."
    return click.option("--dtype", type=click.Choice(DTYPES), default=default, show_default=True, help=text)


def device_option(help: str = "torch engine device (auto: CUDA when present).") -> Callable:
    return click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True, help=help)


def inject_option(help: str = "") -> Callable:
    text = help or ("Inject a known porting bug (repeatable). Free text: the engine lists its faults "
                    "(torch: docs/torch-engine.md) and refuses unknown names. FAULT@LAYERS (torch; e.g. "
                    "comb-not-transposed@3, @1,4, @2-5): a per-layer fault in those layers only.")
    return click.option("--inject", multiple=True, metavar="FAULT[@LAYERS]", help=text)


def numerics_options(fn: Callable) -> Callable:
    """--act-quant, --kv-cache, --rope-angles: the opt-in approximate numerics of RunOptions (first = exact)."""
    from parity.contract.engine import NUMERICS_CHOICES

    words = {"act_quant": "activations rounded before every quantized matmul (q8_0: llama.cpp's CPU backend)",
             "kv_cache": "precision of the stored KV window and compressed rows",
             "rope_angles": "RoPE angles: the official float32 recipe, or ggml's repeated multiplication"}
    for name in reversed(NUMERICS_CHOICES):
        choices = NUMERICS_CHOICES[name]
        fn = click.option(f"--{name.replace('_', '-')}", name, type=click.Choice(choices), default=choices[0],
                          show_default=True, help=f"Approximate numerics, announced on stderr: {words[name]}.")(fn)
    return fn


def tokenizer_option() -> Callable:
    return click.option("--tokenizer", type=click.Choice(["model", "ds4"]), default="model", show_default=True,
                        help="model: the GGUF's own pre-tokenizer and chat template; ds4: exactly ds4's (bytes >= 0x80 "
                             "are letters, the prompt built without the template).")


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """Exactly one of --prompt / --prompt-file -> the text (a file read raw as UTF-8, as ds4 reads it)."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if prompt is not None:
        return prompt
    from parity.tracing.plan import read_prompt_file

    with usage_errors():
        return read_prompt_file(prompt_file)


def engine_arg_option() -> Callable:
    """--engine-arg NAME=VALUE (repeatable): an engine's own settings (`RunOptions.engine_args`), validated by it."""
    return click.option("--engine-arg", "engine_arg", multiple=True, metavar="NAME=VALUE",
                        help="An engine-specific setting (repeatable), validated by the engine; e.g. torch: "
                             "cpu_kernels=torch (torch ops instead of the compiled CPU kernels); llamacpp: "
                             "lcp_threads=N, lcp_flash_attn=on|off, lcp_ctx=N, lcp_ubatch=N, lcp_rs_seq=N "
                             "(docs/peers.md).")


def warn(message: str) -> None:
    """A note for the user on stderr (yellow on a terminal)."""
    click.secho(message, fg="yellow", err=True)


@contextmanager
def usage_errors() -> Iterator[None]:
    """A run plan the options contradict (`parity.tracing.plan.PlanError`) is a usage error: exit status 2."""
    from parity.tracing.plan import PlanError

    try:
        yield
    except PlanError as e:
        raise click.UsageError(str(e)) from None


def json_option(help: str = "Print the result as JSON on stdout (errors too: {\"error\": ..., \"exit_code\": ...}).",
                ) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help=help)


def markdown_option(help: str = "Also write the report as Markdown to FILE ('-': stdout).") -> Callable:
    return click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, allow_dash=True),
                        metavar="FILE", help=help)


def html_option(help: str = "Also write a self-contained HTML report to FILE (for CI artifacts).") -> Callable:
    return click.option("--html", "html_path", type=click.Path(dir_okay=False), metavar="FILE", help=help)


def write_text(path: str, text: str) -> None:
    """Write `text` to `path`, or to stdout when `path` is '-'."""
    if path == "-":
        click.echo(text, nl=not text.endswith("\n"))
    else:
        atomic_write_text(path, text)


def echo_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=False))


def json_errors(fn: Callable) -> Callable:
    """With `as_json` on, a usage or harness error is printed as a JSON object on stdout (exit code kept)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("as_json"):
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except click.ClickException as e:
            echo_json({"error": e.format_message(), "kind": type(e).__name__, "exit_code": e.exit_code})
            raise SystemExit(e.exit_code) from None
        except ParityError as e:
            echo_json({"error": str(e), "kind": type(e).__name__, "exit_code": 2})
            raise SystemExit(2) from None

    return wrapper


def draft_options(what: str) -> Callable:
    """--draft FILE, --mtp-depth K, --mtp-pairing prev|same (trace, bisect, capture); `what` the drafter is used for."""
    def wrap(f: Callable) -> Callable:
        f = click.option("--mtp-pairing", default="prev", show_default=True, type=click.Choice(["prev", "same"]),
                         help="With an MTP --draft: pair X^(L)_{p-1} (prev) or X^(L)_p (same, ds4) with token t_p.")(f)
        f = click.option("--mtp-depth", default=1, show_default=True, type=click.IntRange(1, 99),
                         help="With an MTP --draft: chain depth K (mtp.0.* .. mtp.{K-1}.*).")(f)
        return click.option("--draft", type=click.Path(exists=True, dir_okay=False),
                            help=f"A drafter GGUF (MTP or DSpark, docs/drafters.md): {what}.")(f)
    return wrap


def check_draft_options(draft: str | None) -> None:
    """--mtp-depth / --mtp-pairing given without --draft is a usage error naming them."""
    ctx = click.get_current_context()
    mtp_given = [f"--{n.replace('_', '-')}" for n in ("mtp_depth", "mtp_pairing")
                 if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT]
    if mtp_given and draft is None:
        raise click.UsageError(f"{', '.join(mtp_given)} set(s) the MTP draft head: give --draft FILE")


def pool_options(what: str) -> Callable[[Callable], Callable]:
    """--workers N and --ray [ADDRESS] (check, bisect, validate) for `what` runs (`parity.contract.workpool`)."""
    def deco(f: Callable) -> Callable:
        f = click.option("--ray", "ray", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
                         help=f"Run {what} as Ray tasks on the cluster at ADDRESS (host:port, auto); --ray alone "
                              "starts a local instance. The model must be readable at this path on every node.")(f)
        return click.option("--workers", default=1, show_default=True, type=click.IntRange(1),
                            help=f"Worker processes for {what}; with --ray and no address: the local instance's "
                                 f"CPUs ({LOCAL_RAY_CPUS} if not given). The report is the serial one.")(f)
    return deco


def pool_args(workers: int, ray: str | None) -> tuple[int, str | None]:
    """(workers, ray) as the pool takes them: --workers with --ray ADDRESS is refused (the cluster decides);
    --ray alone gets LOCAL_RAY_CPUS unless --workers is given."""
    ctx = click.get_current_context()
    given = ctx.get_parameter_source("workers") is not click.core.ParameterSource.DEFAULT
    if ray not in (None, "local") and given:
        raise click.UsageError("--workers sets the CPUs of a local Ray instance; with --ray ADDRESS the cluster "
                               "decides")
    return (LOCAL_RAY_CPUS if ray == "local" and not given else workers), ray
