"""What every `alpasim` command shares: the Typer app, the consoles, the options spelled
the same everywhere, loading clusters and cost models, one-line errors and the entry point."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from typer._click import exceptions as click_errors   # typer's own click (it vendors one)

from alpasim import costmodels as cm
from alpasim import experiments as ex
from alpasim import graphs as gr
from alpasim import solvers as sv
from alpasim._gc import relax_gc
from alpasim.units import format_bytes

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, simulate and run Alpa-style parallel training.")
# Written to a file or a pipe, rich lays tables out for 80 columns and folds every long
# cell over many lines (`alpasim validate > table.txt` printed one row over 25); there
# a table takes the width its content needs, up to WIDE_COLUMNS, unless COLUMNS is set.
WIDE_COLUMNS = 200
out = Console()
if not out.is_terminal and not os.environ.get("COLUMNS"):
    out.width = WIDE_COLUMNS
err = Console(stderr=True)

USER_ERRORS = (gr.UnknownModelError, gr.ModelSpecError, gr.GraphFormatError, gr.GraphError, gr.BatchError,
               cm.ClusterError, cm.UnknownPresetError, sv.IntraOpInfeasible, sv.ShardingError,
               sv.PlanInfeasible, sv.PlanFormatError, cm.ProfileFormatError, ex.ReportError)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
ClusterOpt = Annotated[str, typer.Option("--cluster", help="Preset name or cluster JSON file.")]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help="Override the number of nodes.")]
DpnOpt = Annotated[Optional[int], typer.Option("--devices-per-node", help="Override devices per node.")]
GbpsOpt = Annotated[Optional[float], typer.Option("--inter-node-gbps", help="Override inter-node bandwidth.")]
MemOpt = Annotated[Optional[float], typer.Option("--memory-gb", help="Override device memory (GiB).")]
CostModelOpt = Annotated[Optional[Path], typer.Option("--cost-model", help="A profiled cost model JSON "
                                                      "(`alpasim profile`) instead of the analytic model.")]
NoOverlapOpt = Annotated[bool, typer.Option("--no-overlap", help="Reduce each weight gradient after the last "
                                            "backward, one collective per gradient, for every method (default: "
                                            "as each method's system ran, `alpasim methods`).")]
OverlapOpt = Annotated[Optional[bool], typer.Option("--overlap/--no-overlap", help="Reduce the weight gradients "
                                                    "in buckets overlapped with the last backward, or each after "
                                                    "it (default: as the method's system ran, --system).")]
TpOverlapOpt = Annotated[Optional[bool], typer.Option("--tp-comm-overlap/--no-tp-comm-overlap",
                                                      help="Run tensor-parallel collectives beside their GEMMs "
                                                      "(Transformer Engine's comm-GEMM overlap), or in line "
                                                      "(default: as the method's system ran, --system).")]
GatherOverlapOpt = Annotated[Optional[bool], typer.Option(
    "--param-gather-overlap/--no-param-gather-overlap", help="Run a sharded optimizer's parameter all-gathers in "
    "the next forward (Megatron-core's --overlap-param-gather), or after the step (default: as the method's "
    "system ran, --system).")]
CrossEntropyOpt = Annotated[Optional[str], typer.Option(
    "--cross-entropy", help="How the loss kernel runs: fused (one pass over the logits each way) or unfused-fp32 "
    "(Megatron's vocab-parallel loss on logits.float(), a kernel per step); default: as the method's system ran.")]
KernelsOpt = Annotated[Optional[str], typer.Option(
    "--kernels", help="How norms, activations and RoPE run: per-op (each op its own kernel, keeping what its "
    "backward reads, as XLA runs a JAX model) or fused (hand-fused kernels that save their inputs and recompute "
    "the rest in the backward, as Transformer Engine's); default: as the method's system ran.")]
SystemOpt = Annotated[Optional[str], typer.Option("--system", help="Price the plan as this system ran (a profile "
                                                  "of `alpasim methods`: overlap, recomputation, optimizer "
                                                  "sharding; default: the method's own).")]
AttentionOpt = Annotated[Optional[str], typer.Option("--attention", help="Attention kernel of a zoo model: "
                                                     "explicit (the (s, s) scores in memory) or fused (one "
                                                     "FlashAttention-style kernel; default: as the method's "
                                                     "system ran).")]
BucketOpt = Annotated[Optional[float], typer.Option("--bucket-mb", help="Gradient bucket size in MiB for the "
                                                    "overlapped reduction (default: the system's; PyTorch DDP's "
                                                    "25, Megatron-core's max(40M, 1M x dp) parameters).")]


def bucket_bytes(no_overlap: bool, bucket_mb: float | None) -> float | str | None:
    """The planner's `bucket_bytes` for `--no-overlap` / `--bucket-mb` (one line if bad):
    None (no overlap, overriding the system profile), the bucket size, or
    `solvers.SYSTEM_BUCKETS` (the system's own)."""
    if bucket_mb is not None and not (math.isfinite(bucket_mb) and bucket_mb > 0):
        fail(f"--bucket-mb must be a finite number > 0, got {bucket_mb}")
    if no_overlap:
        return None
    return sv.SYSTEM_BUCKETS if bucket_mb is None else bucket_mb * 2 ** 20


PrecisionOpt = Annotated[str, typer.Option("--precision", help="Mixed-precision recipe: mixed-fp32grad (fp16 "
                                           "weights, fp32 gradients, master and Adam: 18 B/param, Megatron-LM's "
                                           "default), mixed (fp16 gradients: 16 B/param) or fp32.")]
RecomputeOpt = Annotated[str, typer.Option("--recompute", help="What the backward recomputes besides --remat: "
                                           "none (keep every value a gradient reads, as eager frameworks and "
                                           "Megatron-LM do), fusible (keep each layer's minimum cut, recompute "
                                           "elementwise, layout, norm and softmax ops in the backward) or "
                                           "selective (attention's QK^T and softmax only: no (s, s) tensor "
                                           "is stashed, as Megatron-LM's selective recomputation); plan "
                                           "also takes auto (the fastest of full remat, selective and "
                                           "none that fits; --remat is then the search's).")]

RayOpt = Annotated[bool, typer.Option("--ray", help="Plan as Ray tasks (a local one-machine cluster, started "
                                      "and stopped here, unless --ray-address or RAY_ADDRESS names one).")]
RayAddressOpt = Annotated[Optional[str], typer.Option("--ray-address", help="Plan on this existing Ray cluster "
                                                     "(e.g. ray://head:10001 or auto); --workers then caps the "
                                                     "tasks in flight.")]
ModelArg = Annotated[Optional[str], typer.Argument(help="Zoo name, spec string, model JSON or graph JSON "
                                                   "(or give it as --model).", show_default=False)]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="Zoo name, spec string, model JSON or graph JSON.")]


def one_model(positional: str | None, option: str | None) -> str:
    """The model of a command that takes it as `--model` (every command's spelling) or,
    as before, positionally: exactly one of the two."""
    if positional is not None and option is not None and positional != option:
        fail(f"two models given ({positional!r} and --model {option!r}); give one")
    model = option if option is not None else positional
    if model is None:
        fail("no model given: pass --model NAME (a zoo name, spec string, model JSON or graph JSON)")
    return model


# Without a terminal, a task's progress line is repeated at most this often (seconds).
PLAIN_PROGRESS_EVERY_S = 5.0


def note(line: str) -> None:
    """One progress line on stderr ("alpasim: ..."), with or without --json."""
    err.print(f"alpasim: {line}", markup=False, highlight=False, soft_wrap=True)


class TaskProgress:
    """Progress of counted tasks on stderr, for every long command, `--json` or not
    (stdout keeps the result only): rich bars on a terminal (transient), and where
    stderr is a file or a pipe, plain lines: each task's first step, then at most one
    line every PLAIN_PROGRESS_EVERY_S, and its last step. `update(label, done, total)`
    is the planner's progress callback."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.bars = None
        self.tasks: dict[str, Any] = {}
        self.t0 = time.perf_counter()
        self.last: dict[str, float] = {}

    def __enter__(self) -> TaskProgress:
        if err.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=err, transient=True)
            self.bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bars is not None:
            self.bars.__exit__(*exc)

    def update(self, label: str, done: int, total: int) -> None:
        name = f"{self.prefix}{label}"
        if self.bars is not None:
            if name not in self.tasks:
                self.tasks[name] = self.bars.add_task(name, total=total)
            self.bars.update(self.tasks[name], completed=done)
            return
        now = time.perf_counter()
        if name not in self.last or done >= total or now - self.last[name] >= PLAIN_PROGRESS_EVERY_S:
            self.last[name] = now
            note(f"{name}: {done}/{total} ({now - self.t0:.0f} s)")


def check_recompute(name: str, search: bool = False) -> None:
    """A policy of `graphs.RECOMPUTE_POLICIES`, or with `search` (a command that plans) "auto"."""
    choices = (*gr.RECOMPUTE_POLICIES, "auto") if search else gr.RECOMPUTE_POLICIES
    if name not in choices:
        fail(f"--recompute {name!r}: choose one of {', '.join(choices)}")


def check_precision(name: str) -> None:
    if name not in gr.RECIPES:
        fail(f"--precision {name!r}: choose one of {', '.join(gr.RECIPES)}")


def fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"alpasim: error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise SystemExit(code)


def _probe_dir(directory: Path, option: str, path: Path) -> None:
    """Create `directory` (and its parents) and write and delete a file in it: the only
    check that holds for root, read-only mounts and ACLs alike."""
    if directory.exists() and not directory.is_dir():
        fail(f"{option} {path}: {directory} is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".alpasim-probe-"):
            pass
    except OSError as e:
        fail(f"{option} {path}: cannot write in {directory}: {e.strerror or e}")


def writable_file(path: Path | None, option: str) -> None:
    """Refuse, before any work starts, an output file that could not be written: a
    directory, or a place where no file can be created (missing parents are made)."""
    if path is None:
        return
    if path.is_dir():
        fail(f"{option} {path}: is a directory; {option} names a file")
    _probe_dir(path.parent, option, path)


def writable_dir(path: Path, option: str) -> None:
    """Refuse, before any work starts, an output directory that is a file or cannot be
    written (it is created if missing)."""
    if path.exists() and not path.is_dir():
        fail(f"{option} {path}: is a file; {option} names a directory")
    _probe_dir(path, option, path)


def write_text(path: Path, text: str, option: str) -> None:
    """Write an output file; a failure (the disk filled after the check) is one line."""
    with writing(path, option):
        path.write_text(text)


@contextlib.contextmanager
def writing(path: Path | None, option: str) -> Iterator[None]:
    """Around writing an output the caller checked with `writable_file` before its work:
    a failure now (the disk filled, a device that takes no data) is one line naming the
    option and the path, not a traceback."""
    try:
        yield
    except OSError as e:
        fail(f"{option} {path}: cannot write: {e.strerror or e}")


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def load_cluster(spec: str, nodes: int | None = None, devices_per_node: int | None = None,
                 inter_node_gbps: float | None = None, memory_gb: float | None = None) -> cm.Cluster:
    """A preset by name or a cluster JSON file, with command-line overrides applied."""
    overrides = {"nodes": nodes, "devices_per_node": devices_per_node,
                 "inter_node_gbps": inter_node_gbps, "memory_gb": memory_gb}
    if spec.endswith(".json") or Path(spec).is_file():
        data = gr.read_json_file(spec, cm.ClusterError)
        try:
            cluster = cm.Cluster.from_json(data)
        except cm.ClusterError as e:
            raise cm.ClusterError(f"{spec}: {e}") from None
        return cluster.with_overrides(**overrides)
    return cm.get_cluster(spec, **overrides)


def load_cost_model(path: Path | None, cluster: cm.Cluster) -> cm.ProfiledCostModel | None:
    """The profile at `path` bound to `cluster` (its intra-node link becomes the measured one)."""
    return None if path is None else cm.ProfiledCostModel.load(path, cluster)


def fmt_count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def fmt_flops(x: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if x >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.3g} FLOP"


fmt_bytes = format_bytes     # one formatter for every size the commands print (`alpasim.units`)


@contextlib.contextmanager
def plan_map(workers: int | None, ray: bool, ray_address: str | None) -> Iterator[Callable]:
    """The map function planning runs on, for a `with` block: Ray tasks, a local pool
    of `solvers.worker_pool` processes (which die with this one; an exception or
    Ctrl-C in the block kills them at once instead of waiting for their jobs), or
    plain map for one worker."""
    check_workers(workers)
    if ray or ray_address:
        from alpasim import backends

        try:
            yield backends.ray_map_fn(ray_address, workers)
        finally:
            backends.ray_shutdown()
        return
    n = workers if workers is not None else (os.cpu_count() or 1)
    if n <= 1:
        yield map
        return
    with sv.worker_pool(n) as pool:      # an exception in the block kills the workers at once
        yield pool.map


def points_map(workers: int | None, ray: bool, ray_address: str | None) -> contextlib.AbstractContextManager:
    """For commands that plan whole points (`sweep`, `reproduce`, `compare`): Ray's map
    when asked, else None (the points' own `worker_pool`)."""
    check_workers(workers)
    return plan_map(workers, True, ray_address) if ray or ray_address else contextlib.nullcontext(None)


def check_workers(workers: int | None) -> None:
    """--workers: None (one per CPU) or at least 1."""
    if workers is not None and workers < 1:
        fail(f"--workers {workers}: must be at least 1 (or leave it out: one per CPU)")


def parse_microbatches(text: str) -> int | str:
    """--microbatches: a positive number, or 'auto' to search B jointly."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        fail(f"--microbatches {text!r}: a positive integer or 'auto'")
    if value < 1:
        fail(f"--microbatches {value}: must be a positive integer or 'auto'")
    return value


def number_list(option: str, text: str, kind: type) -> list:
    """`10,25,50` as numbers of `kind`; a malformed list is a user error."""
    items = [t.strip() for t in text.split(",")]
    try:
        values = [kind(t) for t in items]
    except ValueError:
        fail(f"{option} {text!r}: expected comma-separated {'integers' if kind is int else 'numbers'}, "
             "e.g. 10,25,50")
    if any(not v > 0 for v in values):
        fail(f"{option} {text!r}: every value must be positive")
    return values


def method_list(text: str) -> list[str]:
    try:
        return list(dict.fromkeys(ex.method_name(m) for m in text.split(",")))
    except ValueError as e:
        fail(f"--methods: {e}")


def ensure_cpu_devices(n: int) -> None:
    """Ask XLA for `n` virtual CPU devices — possible only before jax is imported; an
    XLA_FLAGS that already sets a count wins (the device check then says what is short)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) or SIGTERM, raised in the main thread by `main`'s handler. Not
    a KeyboardInterrupt, which click would turn into "Aborted!" and exit 1: this one
    passes through click, stops the worker pools on its way (`plan_map`) and ends as
    one line and exit status 130 (128 + SIGINT) or 143 (SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def main() -> None:
    """Console-script entry point: user errors become one line and exit status 2."""
    relax_gc()
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:   # `alpasim` or a group alone: its help, as asked
        err.print(e.ctx.get_help() if e.ctx is not None else "", markup=False, highlight=False)
        raise SystemExit(2) from None
    except click_errors.UsageError as e:   # unknown option, bad value, missing argument: one line, not a panel
        where = e.ctx.command_path if e.ctx is not None else "alpasim"
        fail(f"{e.format_message()} (`{where} --help` lists the options)")
    except click_errors.ClickException as e:
        fail(e.format_message())
    except Interrupted as e:
        fail("interrupted" if e.signum == signal.SIGINT else "terminated", code=128 + e.signum)
    except USER_ERRORS as e:
        fail(str(e))
    except ValueError as e:  # validation errors from configs and specs
        fail(str(e))
    except OSError as e:     # any file a command could not read or write that no check caught first
        fail(f"{e.filename}: {e.strerror or e}" if e.filename else f"{e.strerror or e}")
    if isinstance(code, int) and code:
        raise SystemExit(code)
