"""Personalization benchmark: one adapter per user per night, PACT against the baselines a user would pick.

Workloads (benchmarks/personal_tasks.py): `nightly` (the default), the built-in dataset's user plus generated users
with private tags (a task a personal adapter must learn: the base model cannot know the tags); `movielens`, the most
active MovieLens users (liked / skip, trained on their past, tested on their later ratings: every method lands near
the majority class, so it cannot tell methods apart); and `lamp2` when you pass official LaMP-2 files
(--lamp-questions / --lamp-outputs). Same model (SmolLM2-135M-Instruct, real weights), same LoRA (r=8, all
linears), same batches and step budget for every backprop method:

    zero_shot  the base model, no adapter            majority    the user's most frequent training tag
    shared     one PACT adapter on all users' data   cpu_bf16    stock peft LoRA in bf16
    fp32       stock peft LoRA in fp32 (reference)   qlora       peft + bitsandbytes nf4
    pact       PactConfig, torch backend             pact_exact  PACT with the `exact` memory savers
    mezo       forward-only MeZO on a LoRA, given PACT's wall-clock on the same user, at the learning rate a sweep
               on a user nobody is evaluated on picked (--mezo-lrs)
Methods not named by a dtype compute in --dtype (auto: bf16 where the CPU has it natively, else fp32, as `pact
finetune` picks); cpu_bf16 runs by default only where bf16 is native (emulated, on an AVX2-only AMD EPYC, its 30
steps took 1071 s against fp32's 49). `pact` on the qnn backend (HTP emulator) runs --qnn-steps steps to check its
losses agree with the torch backend's. Every user is trained once per seed (--seeds: LoRA init, batch order, MeZO's
directions; the users stay the same); accuracy and macro-F1 (the official LaMP definition, over the user's candidate
tags) are averaged over seeds per user, and methods are compared by paired differences: per user, then mean +/-
standard error over users. Training wall-clock per run; peak memory (VmHWM above the idle process) per method in a
fresh process.

    python benchmarks/eval_personalization.py            # 12 users x 3 seeds: hours on 2 cores (see --resume)
    python benchmarks/eval_personalization.py --quick    # minutes: tiny sizes, machinery only
    python benchmarks/eval_personalization.py --table results.json   # print the README table of a past run
    python benchmarks/eval_personalization.py --resume   # finish an interrupted run (results.json is saved per user)
    python benchmarks/eval_personalization.py --resume --seeds 0 1 2 3 4 5 --methods fp32 qlora pact  # more seeds

Every run, memory probe and qnn check on the NVFP4 base records the NVFP4 scale rule it ran under; --resume redoes
those of another rule (a run saved before rules were recorded ran under "6") and keeps the others.

Writes results.json, results.md (the table) and PNG plots to --output; stdout gets ONE JSON line (the summary).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import personal_tasks  # noqa: E402
import personalization_report as report  # noqa: E402
import resume  # noqa: E402
from common import machine, reset_peak_rss, status_bytes, trim_memory  # noqa: E402
from personalization_training import build, evaluate, qnn_agreement, scale_rule, train  # noqa: E402

from optimum_pact.precision.compute_dtype import DTYPES  # noqa: E402

METHODS = ("zero_shot", "majority", "shared", "cpu_bf16", "fp32", "qlora", "pact", "pact_exact", "mezo")
SEEDLESS = ("zero_shot", "majority")  # nothing trained: run on the first seed, the same for the others
NVFP4_METHODS = report.NVFP4_METHODS  # on the NVFP4 base: a kept run under another scale rule is redone
SWEEP_USER = 10_000  # the generated user MeZO's learning rate is chosen on: never one of the evaluated users


def log(*args) -> None:
    print("[eval]", *args, file=sys.stderr, flush=True)


def stands(method: str, run: dict) -> bool:
    """Whether a kept run (or memory probe) of `method` still holds: one on the NVFP4 base only under the scale rule
    in use (`report.run_rule`)."""
    return method not in NVFP4_METHODS or report.run_rule(run) == scale_rule()


def memory_child(args) -> None:
    """In a fresh process: one method on the first user; peak RSS above the idle process, as one JSON line.

    `load_peak_gib` is the peak while the model loads and is prepared (file pages, dtype conversion, quantization);
    `peak_gib`, the number reported, the peak while it trains and evaluates, the resident model included.
    """
    import bitsandbytes  # noqa: F401  every import before the idle measurement
    import peft  # noqa: F401
    from transformers import AutoTokenizer

    import peft_ext  # noqa: F401

    method, seed = args.memory_child, args.seeds[0]
    tasks = next(iter(build_workloads(args).values()))
    task = tasks[0]
    path = model_path(args)
    tokenizer = AutoTokenizer.from_pretrained(path)
    items = [item for t in tasks for item in t.train] if method == "shared" else task.train  # one adapter for all
    data = batches(tokenizer, items, args.steps, args.batch, seed)
    trim_memory()
    idle = status_bytes("VmRSS")
    marks = {}

    def built():
        marks["load"] = status_bytes("VmHWM")
        trim_memory()
        reset_peak_rss()

    run_method(method, task, path, tokenizer, data, args, seed, seconds=args.mezo_seconds, on_built=built)
    gib = {"idle_gib": idle, "load_peak_gib": marks["load"] - idle, "peak_gib": status_bytes("VmHWM") - idle}
    rule = {"nvfp4_scale_rule": scale_rule()} if method in NVFP4_METHODS else {}
    print(json.dumps({"method": method, **{k: v / 2**30 for k, v in gib.items()}, **rule}))


def measure_memory(methods, argv) -> dict:
    """Peak memory per method, each in its own process (in one process the allocator reuses freed memory).

    The shared adapter is trained on all users' items of the first workload, as in the run."""
    import subprocess

    peaks = {}
    for method in methods:
        if method == "majority":
            continue
        probe = ["--memory-child", method, "--mezo-seconds", "5", "--max-test-items", "8"]
        done = subprocess.run([sys.executable, __file__, *argv, *probe], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"memory probe of {method} failed:\n{done.stderr[-2000:]}")
        peaks[method] = json.loads(done.stdout.strip().splitlines()[-1])
        log(f"memory: {method} peaks at {peaks[method]['peak_gib']:.2f} GiB above idle in training "
            f"({peaks[method]['load_peak_gib']:.2f} GiB while loading)")  # fmt: skip
    return peaks


def tokenized(tokenizer, items: list[dict]):
    """The items as the main job tokenizes them (loss on the tag only), and the collator that pads a list of them."""
    from transformers import DataCollatorForSeq2Seq

    from optimum_pact.commands.finetune import tokenize_examples

    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    return tokenize_examples(tokenizer, items), collate


def batches(tokenizer, items: list[dict], steps: int, batch_size: int, seed: int) -> list[dict]:
    """The same `steps` padded batches for every method: epochs over the items, each in a seeded order."""
    import random

    rows, collate = tokenized(tokenizer, items)
    order, rng = [], random.Random(seed)
    while len(order) < steps * batch_size:
        epoch = list(range(len(rows)))
        rng.shuffle(epoch)
        order += epoch
    return [dict(collate([rows[i] for i in order[s * batch_size : (s + 1) * batch_size]])) for s in range(steps)]


def run_method(method: str, task, path: str, tokenizer, data, args, seed: int, seconds=None, on_built=None,
               mezo_lr=None, score_loss=False) -> dict:  # fmt: skip
    """Train (or not) one method on one user (or, for `shared`, on `data` of all users) and evaluate it on the user's
    later items."""
    import lamp

    if method == "majority":
        guess = [task.majority] * len(task.test)
        golds = [i["label"] for i in task.test]
        return {**lamp.lamp2_metrics(guess, golds, task.labels), "predictions": guess, "train_s": 0.0}
    model = build(method, path, args, seed, compiled=method != "mezo")
    if on_built is not None:
        on_built()
    start = time.perf_counter()
    out = {"steps": 0, "losses": []}
    if method == "mezo":
        import mezo

        lr = args.mezo_lr if mezo_lr is None else mezo_lr  # the sweep's choice, else the first of --mezo-lrs
        run = mezo.train_mezo(model, data, seconds, lr=lr, eps=args.mezo_eps, seed=seed)
        out = {"steps": run["steps"], "losses": run["losses"], "lr": lr}
    elif method == "pact_exact":
        import tempfile

        from optimum_pact.memory import MemorySavers

        with tempfile.TemporaryDirectory(prefix="pact-offload-") as offload:
            with MemorySavers.from_preset(model, "exact", offload_dir=offload):
                out = {"steps": len(data), "losses": train(model, data, args.lr)}
    elif method != "zero_shot":
        out = {"steps": len(data), "losses": train(model, data, args.lr)}
    train_s = time.perf_counter() - start
    result = evaluate(model, tokenizer, task)
    if score_loss:
        from optimum_pact.commands.evaluation import heldout_loss  # the main job's: loss per label token

        result["heldout_loss"] = heldout_loss(model, *tokenized(tokenizer, task.test), args.batch)
    del model
    losses = out.pop("losses")
    return {**result, **out, "train_s": train_s, "first_losses": losses[:3],
            "last_losses": losses[-3:], "all_losses": losses}  # fmt: skip


def sweep_mezo_lr(path: str, tokenizer, args) -> dict:
    """MeZO's learning rate, chosen on a generated user nobody is evaluated on (`SWEEP_USER`), first seed.

    PACT trains that user first; each of `--mezo-lrs` then gets PACT's wall-clock there. The lowest loss on that
    user's later items wins (a diverged run: infinite). Loss, not accuracy: on a few dozen items accuracy moves in
    steps of several points and picked, in a first run, a rate whose training loss had doubled.
    """
    import math

    import personal_users

    if len(args.mezo_lrs) == 1:
        return {"lr": args.mezo_lrs[0], "swept": False}
    items = personal_users.generate_user(SWEEP_USER, args.items_per_user, seed=args.data_seed)
    task = personal_tasks.split_user("sweep", f"generated-{SWEEP_USER}", items, args.test_fraction)
    task.test = task.test[: args.max_test_items]
    seed = args.seeds[0]
    data = batches(tokenizer, task.train, args.steps, args.batch, seed)
    pact = run_method("pact", task, path, tokenizer, data, args, seed, score_loss=True)
    seconds, runs = pact["train_s"], {}
    for lr in args.mezo_lrs:
        run = run_method("mezo", task, path, tokenizer, data, args, seed, seconds=seconds, mezo_lr=lr, score_loss=True)
        heldout = run["heldout_loss"] if math.isfinite(run["heldout_loss"]) else math.inf
        losses = run["first_losses"][:1] + run["last_losses"][-1:] or [math.nan, math.nan]
        runs[lr] = {"heldout_loss": heldout, "accuracy": run["accuracy"], "steps": run["steps"]}
        runs[lr]["first_loss"], runs[lr]["last_loss"] = losses[0], losses[-1]
        log(f"mezo sweep lr {lr:g}: held-out loss {heldout:.3f}, accuracy {run['accuracy']:.1%}, training loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f} ({run['steps']} steps)")  # fmt: skip
    best = min(runs, key=lambda lr: runs[lr]["heldout_loss"])
    log(f"mezo sweep: lr {best:g} (PACT there: {seconds:.1f} s, held-out loss {pact['heldout_loss']:.3f})")
    return {"lr": best, "swept": True, "user": task.user, "seconds": seconds, "runs": runs,
            "pact_heldout_loss": pact["heldout_loss"]}  # fmt: skip


def run_workload(name: str, tasks, path: str, tokenizer, args, methods, kept: dict, on_user=None) -> dict:
    """Every method on every user, once per seed; per user and method the runs by seed and their means.

    `kept` holds this workload's users from an earlier run of the same settings: their runs are not redone, and the
    runs of methods this one leaves out are carried over as they are (a resumed run may add seeds to some methods).
    `on_user(workload)` is called after each user and seed (to save the results so far)."""
    carried = [m for m in METHODS if m not in methods and any(m in u.get("methods", {}) for u in kept.values())]
    users = {
        task.user: {"train_items": len(task.train), "test_items": len(task.test), "labels": list(task.labels),
                    "golds": [i["label"] for i in task.test],
                    "methods": {m: {"seeds": {}} for m in [*methods, *carried]}}
        for task in tasks
    }  # fmt: skip
    stale = 0
    for user, entry in users.items():
        for method, runs in entry["methods"].items():
            saved = kept.get(user, {}).get("methods", {}).get(method, {}).get("seeds", {})
            keep = {seed: run for seed, run in saved.items() if method in carried or stands(method, run)}
            runs["seeds"].update(keep)
            stale += len(saved) - len(runs["seeds"])
    if stale:
        log(f"{name}: {stale} kept runs on the NVFP4 base used another scale rule: redone under {scale_rule()!r}")
    for seed in args.seeds:
        todo = [t for t in tasks if any(seed not in users[t.user]["methods"][m]["seeds"] for m in methods)]
        if todo:
            log(f"{name} seed {seed}: {len(todo)} of {len(tasks)} users to run")
        if "shared" in methods and any(seed not in users[t.user]["methods"]["shared"]["seeds"] for t in todo):
            pooled = [item for task in tasks for item in task.train]
            log(f"{name} seed {seed}: shared adapter on {len(pooled)} items of {len(tasks)} users")
            shared = build("shared", path, args, seed)
            start = time.perf_counter()
            shared_losses = train(shared, batches(tokenizer, pooled, args.steps, args.batch, seed), args.lr)
            shared_info = {"train_s": time.perf_counter() - start, "steps": args.steps,
                           "last_losses": shared_losses[-3:]}  # fmt: skip
        for task in todo:
            data = batches(tokenizer, task.train, args.steps, args.batch, seed)
            runs = users[task.user]["methods"]
            for method in methods:
                if seed in runs[method]["seeds"]:
                    continue
                if method == "shared":
                    run = {**evaluate(shared, tokenizer, task), **shared_info}
                elif method in SEEDLESS and runs[method]["seeds"]:  # the same answers whatever the seed
                    run = next(iter(runs[method]["seeds"].values()))
                else:
                    seconds = runs.get("pact", {"seeds": {}})["seeds"].get(seed, {}).get("train_s", args.mezo_seconds)
                    run = run_method(method, task, path, tokenizer, data, args, seed, seconds=seconds)
                if method in NVFP4_METHODS:
                    run = {**run, "nvfp4_scale_rule": scale_rule()}
                runs[method]["seeds"][seed] = run
                log(f"{name}/{task.user} seed {seed} {method}: accuracy {run['accuracy']:.1%} macro-F1 "
                    f"{run['f1']:.3f} ({run.get('steps', 0)} steps, {run['train_s']:.1f} s)")  # fmt: skip
            if on_user is not None:
                on_user(seed_means(users))
        shared = None
    return seed_means(users)


def seed_means(users: dict) -> dict:
    """The workload entry: per user and method, the mean over the seeds run so far of each figure."""
    for user in users.values():
        for entry in user["methods"].values():
            for key in ("accuracy", "f1", "train_s", "steps"):
                values = [run[key] for run in entry["seeds"].values() if run.get(key) is not None]
                entry[key] = sum(values) / len(values) if values else None
    return {"users": users}


def resumed(args, out: Path) -> dict:
    """With --resume, the results.json of an earlier run in `out` (seed keys back to ints), if its settings are
    these; else {}. Settings that differ are a clear error: mixing them would compare unlike runs. --seeds and
    --methods may differ: a resumed run adds the seeds and methods it names and keeps every run saved (see
    `run_workload`), so more seeds can be added to the methods whose comparison is still noise."""
    saved = out / "results.json"
    if not args.resume or not saved.exists():
        return {}
    previous = json.loads(saved.read_text())
    ignore = ("resume", "memory", "mezo_lr", "qnn_steps", "dtype", "seeds", "methods")  # what may change between
    # the pieces of one run; --dtype as typed may, for what it resolved to, compute_dtype, is compared: `auto` is
    # fp32 on one CPU and bf16 on another
    mine = {k: v for k, v in vars(args).items() if k not in ("table", "output", *ignore)}
    theirs = {k: v for k, v in previous["config"].items() if k not in ignore}
    resume.check_settings(saved, theirs, mine)
    for workload in previous["workloads"].values():
        for user in workload["users"].values():
            for entry in user["methods"].values():
                entry["seeds"] = {int(seed): run for seed, run in entry["seeds"].items()}
    log(f"--resume: keeping the runs in {saved}")
    return previous


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        help="default: all, less cpu_bf16 where the CPU has no native bf16 (emulated there: 22x fp32's step time)",
    )
    parser.add_argument("--workloads", nargs="+", choices=("nightly", "movielens"), default=["nightly"])
    parser.add_argument("--steps", type=int, default=30, help="steps per adapter (every backprop method)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="each trains every user once: LoRA init, batch order, MeZO's directions",
    )
    parser.add_argument("--data-seed", type=int, default=0, help="the generated users (the same for every seed)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="compute dtype of the methods not named by one (auto: bf16 where the CPU has it natively, else fp32)",
    )
    parser.add_argument("--generated-users", type=int, default=11, help="besides the built-in user")
    parser.add_argument("--items-per-user", type=int, default=200, help="generated and MovieLens users")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="the user's latest items held out")
    parser.add_argument("--movielens-users", type=int, default=6, help="the most active users")
    parser.add_argument("--movielens-user-ids", type=int, nargs="+", help="these users instead of the most active")
    parser.add_argument("--movielens-deb", help="an r-cran-dslabs .deb to read instead of `apt-get download`")
    parser.add_argument("--lamp-questions", help="LaMP-2 questions JSON: adds the lamp2 workload")
    parser.add_argument("--lamp-outputs", help="LaMP-2 outputs JSON (the gold tags) for --lamp-questions")
    parser.add_argument("--lamp-users", type=int, default=20, help="the first N LaMP-2 questions")
    parser.add_argument(
        "--mezo-lrs",
        type=float,
        nargs="+",
        default=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
        help="MeZO learning rates swept on a user nobody is evaluated on (one value: no sweep)",
    )
    parser.add_argument("--mezo-eps", type=float, default=1e-3)
    parser.add_argument("--mezo-seconds", type=float, default=30.0, help="MeZO's budget when pact is not run")
    parser.add_argument("--qnn-steps", type=int, default=2, help="steps of PACT on qnn (0: skip)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the cpu_bf16 baseline")
    parser.add_argument("--output", help="results folder (default: <cache>/personalization)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: machinery only, minutes")
    parser.add_argument("--max-test-items", type=int, help="evaluate each user on at most this many later items")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the per-method memory probes")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs --output's results.json holds (an interrupted run of these settings) and run the rest",
    )
    parser.add_argument("--memory-child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--table", metavar="RESULTS_JSON", help="print the markdown table of a past run and exit")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.generated_users, args.items_per_user = 2, 2, 1, 12
        args.movielens_users, args.lamp_users, args.qnn_steps, args.max_test_items = 1, 1, 0, 8
        args.seeds, args.mezo_lrs = args.seeds[:1], args.mezo_lrs[:2]
    args.mezo_lr = args.mezo_lrs[0]  # until the sweep chooses (main)
    args.compute_dtype = resume.ran_dtype(args.dtype)
    if args.methods is None:
        from optimum_pact.precision.compute_dtype import native_bf16

        args.methods = [m for m in METHODS if m != "cpu_bf16" or native_bf16()]
        if "cpu_bf16" not in args.methods and not args.memory_child:
            log("cpu_bf16 left out: no native bf16 on this CPU (emulated: ~22x fp32's step); --methods runs it")
    if (args.lamp_questions is None) != (args.lamp_outputs is None):
        parser.error("--lamp-questions and --lamp-outputs go together: the questions and their gold outputs")
    for name in ("steps", "batch", "items_per_user", "movielens_users", "lamp_users"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if not 0 < args.test_fraction < 1:
        parser.error(f"--test-fraction {args.test_fraction} must be between 0 and 1 (exclusive)")
    return args


def build_workloads(args) -> dict:
    """Every user task, built (and its errors raised) before any training."""
    workloads = {}
    if "nightly" in args.workloads:
        workloads["nightly"] = personal_tasks.nightly_tasks(
            args.generated_users, args.items_per_user, args.test_fraction, args.data_seed
        )
    if "movielens" in args.workloads:
        workloads["movielens"] = personal_tasks.movielens_tasks(
            args.movielens_users, args.items_per_user, args.test_fraction, args.movielens_user_ids, args.movielens_deb
        )
    if args.lamp_questions:
        workloads["lamp2"] = personal_tasks.lamp2_tasks(args.lamp_questions, args.lamp_outputs, args.lamp_users)
    for tasks in workloads.values():
        for task in tasks:
            task.test = task.test[: args.max_test_items]
    return workloads


def save(results: dict, out: Path) -> None:
    """results.json and results.md, each replaced whole (written beside, then renamed)."""
    report.summarize(results)
    for name, text in (
        ("results.json", json.dumps(results, indent=1)),
        ("results.md", report.markdown_table(results)),
    ):
        partial = out / f".{name}.partial"
        partial.write_text(text + "\n")
        partial.replace(out / name)


def model_path(args) -> str:
    from optimum_pact.commands.default_model import ensure_default_model

    return args.model or str(ensure_default_model())


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.table:
        print(report.markdown_table(json.loads(Path(args.table).read_text())))
        return {}
    if args.memory_child:
        memory_child(args)
        return {}
    from transformers import AutoTokenizer

    from optimum_pact.cache import cache_dir

    default_out = cache_dir() / ("personalization-quick" if args.quick else "personalization")
    out = Path(args.output) if args.output else default_out
    out.mkdir(parents=True, exist_ok=True)
    workloads = build_workloads(args)
    path = model_path(args)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    methods = [m for m in METHODS if m in args.methods]
    if "mezo" in methods and "pact" in methods:  # MeZO gets PACT's wall-clock: run PACT first
        methods.remove("mezo")
        methods.insert(methods.index("pact") + 1, "mezo")
    start = time.perf_counter()
    results = {
        "bench": "eval_personalization",
        "machine": machine(),
        "date": date.today().isoformat(),
        "config": {k: v for k, v in vars(args).items() if k not in ("table", "output")},
        "workloads": {},
    }
    previous = resumed(args, out)
    piece = {k: results[k] for k in ("machine", "date")}  # a resumed run may span days (and machines): each piece
    piece.update(seeds=args.seeds, methods=methods)  # what this sitting ran (the config: what the run holds)
    results["pieces"] = [*previous.get("pieces", []), piece]
    if previous:
        config, before = results["config"], previous["config"]
        config["seeds"] = sorted({*before["seeds"], *args.seeds})
        config["methods"] = [m for m in METHODS if m in before["methods"] or m in methods]

    def stamp(complete: bool) -> None:  # this sitting's wall-clock, the run's so far, and save
        piece["wall_s"] = time.perf_counter() - start
        results["wall_s"], results["complete"] = previous.get("wall_s", 0.0) + piece["wall_s"], complete
        save(results, out)

    if "mezo" in methods or "mezo_sweep" in previous:
        results["mezo_sweep"] = previous.get("mezo_sweep") or sweep_mezo_lr(path, tokenizer, args)
        args.mezo_lr = results["config"]["mezo_lr"] = results["mezo_sweep"]["lr"]
    for name, tasks in workloads.items():

        def on_user(workload, name=name):  # a crash (or ^C) keeps every finished user and seed: see --resume
            results["workloads"][name] = workload
            stamp(complete=False)

        kept = previous.get("workloads", {}).get(name, {}).get("users", {})
        results["workloads"][name] = run_workload(name, tasks, path, tokenizer, args, methods, kept, on_user)
        save(results, out)
    if "qnn_agreement" in previous and stands("pact", previous["qnn_agreement"]):
        results["qnn_agreement"] = previous["qnn_agreement"]
    elif args.qnn_steps and "pact" in methods and "nightly" in workloads:
        task = workloads["nightly"][0]
        data = batches(tokenizer, task.train, args.steps, args.batch, args.seeds[0])
        log(f"qnn agreement: {args.qnn_steps} steps on the HTP emulator")
        try:
            results["qnn_agreement"] = qnn_agreement(task, path, tokenizer, data, args)
        except Exception as err:  # keep the hour of results above; the error is reported in them
            log(f"qnn agreement failed: {err!r}")
            results["qnn_agreement"] = {"error": repr(err)}
    child_argv = [*argv, "--mezo-lrs", str(getattr(args, "mezo_lr", args.mezo_lrs[0]))]
    kept_memory = {m: peak for m, peak in previous.get("memory", {}).items() if m not in methods or stands(m, peak)}
    todo = [m for m in methods if m not in kept_memory] if args.memory else []
    results["memory"] = {**kept_memory, **measure_memory(todo, child_argv)}
    stamp(complete=True)
    results["plots"] = report.plot(results, out)
    summary = {k: results[k] for k in ("bench", "date", "wall_s", "summary", "targets", "plots")}
    summary["qnn_agreement"] = results.get("qnn_agreement", {})
    summary["output"] = str(out)
    print(json.dumps(summary))
    return results


if __name__ == "__main__":
    main()
