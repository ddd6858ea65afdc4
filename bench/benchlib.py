"""What the benches share: the job environment, the base model (built by the base_model stage's own code), the
tracker stand-in and the results file; stage configs come from launcher.config.stage_config. Each bench's
`--tiny` mode swaps SmolLM2-135M-Instruct for the schema's tiny random Llama (model.tiny, with its trained
tokenizer) so that tests/test_benches.py can run every bench's code path for one step in seconds.

Step times (issue #16): a throughput bench's defaults time at least MIN_STEADY_STEPS steps after its warmup, and its
results give each side's steady mean, median, min and max (`steady_stats`): one step's time varies too much (TRL's
GRPO steps ranged 16-41 s in one invocation while response lengths varied) for a single step or a short mean.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launcher.config import stage_config  # noqa: E402  (needs REPO on sys.path)
from runtime.job import JOB_ENV  # noqa: E402

os.environ.update(JOB_ENV)  # what every stage's job and Ray worker runs with: offline hub, in-process vLLM, ...
SIDES = ("alignpipe", "trl", "trl-defaults")
# trl-defaults: TRL as its configs default (bf16=True, gradient checkpointing), what a TRL user gets without asking;
# run by default only on a CPU with native bf16 (elsewhere its bf16 is emulated, minutes per step).
TRL_DEFAULTS = "trl-defaults"
MIN_STEADY_STEPS = 8  # the defaults time at least this many steps after the warmup


class StepTimer:
    """Stands in for a stage's MLflow run (runtime/tracking.py, StageRun): records when each step's metrics
    arrive (`times`, from `start()`) and where the actors ran; no checkpoints."""
    checkpoint_dir = None

    def __init__(self):
        self.placements: list[dict] = []
        self.start()

    def start(self) -> None:
        self.times = [time.perf_counter()]

    def record_placements(self, placements: list[dict]) -> None:
        self.placements.extend(placements)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.times.append(time.perf_counter())

    def log_artifact(self, path) -> None:
        pass

    def set_tags(self, tags: dict) -> None:
        pass

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def trl_defaults(own_defaults: bool, precision: str) -> dict:
    """TRL's config keys that the benches set for equal work: fp32 or bf16 autocast as alignpipe's side, no gradient
    checkpointing; none for the trl-defaults side, which keeps TRL's own (bf16, gradient checkpointing)."""
    return {} if own_defaults else {"bf16": precision == "bf16", "fp16": False, "gradient_checkpointing": False}


def trl_step_timer(times: list[float]):
    """A transformers TrainerCallback appending each optimizer step's seconds to `times`: the wall time from the end
    of the previous step (for the first, the start of training) to the end of this one, which is what StepTimer
    measures on alignpipe's side (the time between two steps' metrics). Between on_step_begin and on_step_end
    instead, a step would leave out the fetching and collating of its batch."""
    from transformers import TrainerCallback

    class StepEnds(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

    return StepEnds()


def default_model(tiny: bool) -> Path:
    return REPO / "results" / "bench" / ("tiny" if tiny else "smollm2-135m-instruct")


def base_model(model_dir: Path, tiny: bool) -> Path:
    """The bench's base model in `model_dir`, built once by the base_model stage (SmolLM2-135M-Instruct, or with
    `tiny` the schema's model.tiny: a random Llama with a BPE tokenizer trained on reviews)."""
    if (model_dir / "config.json").exists():
        return model_dir
    from stages import base_model as stage
    cfg = stage_config(stage, {"seed": 0, "model": {"source": "tiny" if tiny else "smollm2-135m-instruct"}}, "model")
    partial = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    stage.run(cfg, {}, partial, StepTimer())
    partial.rename(model_dir)
    print(f"[bench] base model {cfg.source} -> {model_dir}", flush=True)
    return model_dir


def add_common_args(parser, name: str, steps: int, warmup: int, sides: tuple[str, ...] = SIDES) -> None:
    """--model, --steps, --warmup, --tiny, --sides, --out: the options every throughput bench has (`sides`: what
    it can run, each in a process of its own)."""
    parser.add_argument("--model", type=Path, help="base model directory (built there if missing; default "
                        "results/bench/smollm2-135m-instruct, with --tiny results/bench/tiny)")
    assert steps - warmup >= MIN_STEADY_STEPS, "a bench's defaults time at least MIN_STEADY_STEPS steady steps"
    parser.add_argument("--steps", type=int, default=steps, help=f"steps per side (default {steps}: {warmup} "
                        f"warmup + {steps - warmup} steady; fewer than {MIN_STEADY_STEPS} steady steps only to "
                        f"check the code path)")
    parser.add_argument("--warmup", type=int, help=f"first steps left out of the steady-state figures "
                        f"(default {warmup}, at most --steps - 1)")
    parser.add_argument("--tiny", action="store_true", help="the schema's tiny random model instead of SmolLM2: "
                        "checks the bench's code path (tests/test_benches.py), measures nothing")
    from runtime.models import cpu_bf16_flags
    parser.add_argument("--sides", default=",".join(s for s in sides if s != TRL_DEFAULTS or cpu_bf16_flags()),
                        help=f"comma-separated sides to run ({','.join(sides)}; {TRL_DEFAULTS}: TRL at its own "
                        "defaults, bf16 and gradient checkpointing, by default only on a CPU with native bf16); "
                        "without trl, no TRL is needed")
    parser.add_argument("--out", type=Path, help=f"results file (default bench/results/{name}.json; with --tiny "
                        f"results/bench/tiny/{name}.json, so a tiny run never overwrites a real run's results)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="both sides' precision (default fp32): alignpipe's `precision` (bf16: bf16 weights with "
                        "DeepSpeed's fp32 master weights, vLLM in bf16; needs a CPU with native bf16), TRL's bf16 "
                        "(autocast over fp32 weights)")
    parser.add_argument("--only", choices=sides, help="internal: run one side in this process, print its step times")
    parser.set_defaults(bench_name=name, default_warmup=warmup, all_sides=sides)


def finish_args(parser, args) -> None:
    """Fill in the defaults that depend on other options, and check them."""
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.warmup is None:
        args.warmup = min(args.default_warmup, args.steps - 1)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be in [0, --steps) = [0, {args.steps})")
    args.sides = [s for s in args.sides.split(",") if s]
    if not args.sides or set(args.sides) - set(args.all_sides):
        parser.error(f"--sides {','.join(args.sides)}: choose from {','.join(args.all_sides)}")
    args.model = args.model or default_model(args.tiny)
    if args.out is None:
        args.out = REPO / ("results/bench/tiny" if args.tiny else "bench/results") / f"{args.bench_name}.json"
    if not args.tiny and not args.only and args.steps - args.warmup < MIN_STEADY_STEPS:
        print(f"[bench] note: {args.steps - args.warmup} steady steps (< {MIN_STEADY_STEPS}): the figures are not "
              f"comparable with docs/benchmarks.md's", file=sys.stderr, flush=True)


def steady_stats(times: list[float], warmup: int) -> dict:
    """Mean, median, min and max of the step times after the first `warmup`, and how many there are."""
    steady = times[warmup:]
    return {"mean": statistics.fmean(steady), "median": statistics.median(steady), "min": min(steady),
            "max": max(steady), "steps": len(steady)}


def side_results(times: list[float], warmup: int, rate_key: str, items_per_step: int) -> dict:
    """A side's entry in the results file: every step's seconds, the steady mean (`steady_seconds_per_step`) and
    the rate it gives (`rate_key`: items_per_step per steady second), and `steady_step_seconds` (steady_stats)."""
    stats = steady_stats(times, warmup)
    return {"step_seconds": times, "steady_seconds_per_step": stats["mean"],
            rate_key: items_per_step / stats["mean"], "steady_step_seconds": stats}


def describe(side: str, result: dict, rate_key: str, unit: str) -> str:
    """One side's printed summary line."""
    s = result["steady_step_seconds"]
    return (f"{side}: {result[rate_key]:.3f} {unit}/s, steady s/step mean {s['mean']:.2f} median {s['median']:.2f} "
            f"min {s['min']:.2f} max {s['max']:.2f} over {s['steps']} steps")


def run_side(script: str, side: str, argv: list[str], steps: int) -> tuple[list[float], list[str]]:
    """Run one side in its own process (`script --only side *argv`): neither side inherits the other's threads or
    memory. Its step times (the `STEP_TIMES` line) and its stdout lines; exits with its output if it failed."""
    out = subprocess.run([sys.executable, script, "--only", side, *argv], capture_output=True, text=True)
    lines = out.stdout.splitlines()
    found = tagged(lines, "STEP_TIMES")
    if out.returncode != 0 or not found:
        sys.exit(f"{side} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    times = found[0]
    if len(times) != steps:
        sys.exit(f"{side} ran {len(times)} steps, not {steps}:\n{out.stdout[-3000:]}")
    return times, lines


def matmul_gflops(dtype_name: str, size: int = 2048, repeats: int = 8) -> float:
    """This machine's dense matmul rate in `dtype_name` on all its cores: a size x size product, timed after two
    untimed ones."""
    import torch
    torch.set_num_threads(os.cpu_count())
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e9


def machine() -> dict:
    """What bounds a CPU bench here (issue #47): the processor, its cores, its native bf16 instructions and its
    measured float32 and bfloat16 matmul rates (the peaks a training step's FLOP/s compares with)."""
    from runtime.models import cpu_bf16_flags
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    native = cpu_bf16_flags()
    # (bfloat16 without native instructions is emulated, ~1 GFLOP/s: a smaller product says so in a second)
    result = {"cpu": name, "cores": os.cpu_count(), "native_bf16": native,
              "matmul_gflops": {"float32": matmul_gflops("float32"),
                                "bfloat16": matmul_gflops("bfloat16", size=2048 if native else 256)}}
    rates = result["matmul_gflops"]
    print(f"[bench] machine: {name or 'CPU'}, {result['cores']} cores, native bf16: "
          f"{', '.join(result['native_bf16']) or 'none'}; matmul {rates['float32']:.0f} GFLOP/s float32, "
          f"{rates['bfloat16']:.0f} bfloat16", flush=True)
    return result


def training_gflops(model_dir: Path, positions: int, seconds: float) -> float:
    """A training phase's achieved rate: 6 FLOPs per parameter per trained position (a forward and its backward,
    Kaplan et al. 2020), on the positions the rows hold, not their padding."""
    from launcher.memory import ModelSize
    params = ModelSize.from_config(json.loads((model_dir / "config.json").read_text()), str(model_dir)).params
    return 6 * params * positions / seconds / 1e9


def print_training_rate(side: str, gflops: float, machine: dict) -> None:
    """The achieved rate against the machine's matmul peaks (`machine()`; bf16's where the CPU has it natively)."""
    peaks = machine["matmul_gflops"]
    bf16_peak = f"{gflops / peaks['bfloat16']:.0%} of the machine's bf16 matmul peak, " if machine["native_bf16"] \
        else "(no native bf16) "
    print(f"{side} training: {gflops:.0f} GFLOP/s achieved, {bf16_peak}{gflops / peaks['float32']:.0%} of its "
          "float32 one", flush=True)


def emit(tag: str, value) -> None:
    """Print `value` as a JSON line tagged `tag`, for the parent process (`tagged`)."""
    print(f"{tag} {json.dumps(value)}", flush=True)


def tagged(lines: list[str], tag: str) -> list:
    """The values of the lines `emit` printed with `tag`, in order."""
    return [json.loads(line.removeprefix(tag + " ")) for line in lines if line.startswith(tag + " ")]


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"results -> {path}", flush=True)
