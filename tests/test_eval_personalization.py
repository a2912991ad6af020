"""The personalization benchmark: LaMP-2 loader and official metrics, user tasks, MeZO, and --quick end to end."""

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
FIXTURE = Path(__file__).parent / "fixtures" / "lamp2"
sys.path.insert(0, str(BENCH))

import lamp  # noqa: E402
import mezo  # noqa: E402
import movielens  # noqa: E402
import personal_tasks  # noqa: E402
import personal_users  # noqa: E402


def test_lamp2_fixture_loads_with_golds():
    questions = lamp.load_lamp2(FIXTURE / "dev_questions.json", FIXTURE / "dev_outputs.json")
    assert [q.id for q in questions] == ["110", "210", "310"]
    assert [q.output for q in questions] == ["comedy", "sci-fi", "action"]
    assert all(len(q.profile) == 8 for q in questions)
    assert questions[0].description == "A wedding planner accidentally books the same venue for three couples."
    assert set(questions[0].profile[0]) == {"id", "tag", "description"}
    assert all(p["tag"] in lamp.LAMP2_TAGS for q in questions for p in q.profile)
    assert lamp.load_lamp2(FIXTURE / "dev_questions.json")[0].output is None  # questions alone: no golds


def test_lamp2_metrics_follow_the_official_definition():
    # preds map to [comedy, sci-fi, not-a-tag], golds to [comedy, action, sci-fi]: one right; only comedy has F1 > 0
    got = lamp.lamp2_metrics(["comedy ", "sci-fi", "drama"], ["comedy", "action", "sci-fi"])
    assert got["accuracy"] == pytest.approx(1 / 3)
    assert got["f1"] == pytest.approx(1 / 15)  # macro over all 15 tags, absent tags scoring 0 (sklearn's convention)
    two = lamp.lamp2_metrics(["a", "a", "b"], ["a", "b", "b"], labels=("a", "b"))
    assert two == {"accuracy": pytest.approx(2 / 3), "f1": pytest.approx(2 / 3)}  # F1(a) = F1(b) = 2/3


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda q: q[1].pop("profile"), '"profile"'),
        (lambda q: q[0]["profile"][2].pop("tag"), '"tag"'),
        (lambda q: q[2].update(input=["not", "a", "string"]), '"input"'),
    ],
)
def test_lamp2_wrong_schema_names_the_field(tmp_path, mutate, field):
    questions = json.loads((FIXTURE / "dev_questions.json").read_text())
    mutate(questions)
    path = tmp_path / "questions.json"
    path.write_text(json.dumps(questions))
    with pytest.raises(ValueError, match=field) as err:
        lamp.load_lamp2(path)
    assert str(path) in str(err.value) and "schema" in str(err.value)


def test_lamp2_outputs_schema_and_task_are_checked(tmp_path):
    outputs = tmp_path / "outputs.json"
    outputs.write_text(json.dumps({"task": "LaMP_2", "golds": [{"id": "110"}]}))
    with pytest.raises(ValueError, match='"output"'):
        lamp.load_lamp2(FIXTURE / "dev_questions.json", outputs)
    outputs.write_text(json.dumps({"task": "LaMP_4", "golds": []}))
    with pytest.raises(ValueError, match="LaMP_2"):
        lamp.load_lamp2(FIXTURE / "dev_questions.json", outputs)
    outputs.write_text(json.dumps({"task": "LaMP_2", "golds": [{"id": "110", "output": "comedy"}]}))
    with pytest.raises(ValueError, match="no gold output for question ids"):
        lamp.load_lamp2(FIXTURE / "dev_questions.json", outputs)


def test_lamp2_tasks_train_on_the_profile_and_reject_short_ones(tmp_path):
    tasks = personal_tasks.lamp2_tasks(FIXTURE / "dev_questions.json", FIXTURE / "dev_outputs.json")
    assert [len(t.train) for t in tasks] == [8, 8, 8] and [t.test[0]["label"] for t in tasks] == [
        "comedy",
        "sci-fi",
        "action",
    ]
    assert tasks[0].labels == lamp.LAMP2_TAGS
    questions = json.loads((FIXTURE / "dev_questions.json").read_text())
    questions[1]["profile"] = questions[1]["profile"][:3]
    path = tmp_path / "questions.json"
    path.write_text(json.dumps(questions))
    with pytest.raises(ValueError, match="question 210 has a profile of 3 items"):
        personal_tasks.lamp2_tasks(path, FIXTURE / "dev_outputs.json")


def test_a_user_with_too_few_items_is_a_clear_error():
    items = [{"text": f"note {i}", "label": "a" if i % 2 else "b"} for i in range(6)]
    with pytest.raises(
        ValueError, match=r"movielens user 42 has 6 items; a user needs at least 10 .*--items-per-user"
    ):
        personal_tasks.split_user("movielens", 42, items, 0.2, hint=" (--items-per-user)")
    task = personal_tasks.split_user("nightly", "u", items * 2, 0.25)
    assert (len(task.train), len(task.test)) == (9, 3) and task.test == (items * 2)[9:]  # the latest items held out
    assert task.labels == ("a", "b") and task.majority in ("a", "b")


def test_generated_users_are_deterministic_and_use_private_tags():
    a, b = personal_users.generate_user(0, 50), personal_users.generate_user(1, 50)
    assert a == personal_users.generate_user(0, 50)
    assert {i["label"] for i in a} != {i["label"] for i in b}
    assert len({i["text"] for i in a}) > 30  # varied notes, not a handful repeated


def test_movielens_item_text_and_label():
    record = {"title": "Toy Story", "year": 1995, "genres": "Adventure|Animation", "rating": 4.0}
    assert movielens.item(record) == {"text": "Toy Story (1995), Adventure, Animation", "label": "liked"}
    assert movielens.item({**record, "rating": 3.5, "year": None})["label"] == "skip"
    with pytest.raises(ValueError, match="no user 0"):
        movielens.user_items({1: [record]}, 0, 10)


def test_mezo_descends_with_forward_passes_only():
    torch.manual_seed(0)
    target = torch.randn(32)
    param = torch.nn.Parameter(torch.zeros(32))
    optimizer = mezo.MeZO([param], lr=2e-3, eps=1e-3, seed=0)
    loss = lambda: ((param - target) ** 2).sum()  # noqa: E731
    start = loss().item()
    for _ in range(400):
        optimizer.step(loss)
    assert param.grad is None  # no autograd anywhere
    assert loss().item() < 0.5 * start


def test_mezo_step_restores_then_moves_along_the_seeded_direction():
    param = torch.nn.Parameter(torch.zeros(8))
    optimizer = mezo.MeZO([param], lr=0.1, eps=1e-2, seed=3)
    optimizer.step(lambda: param.sum())  # L+ - L- = 2 eps sum(z): grad estimate sum(z)
    z = torch.randn(8, generator=torch.Generator().manual_seed(3 * 1_000_003))
    torch.testing.assert_close(param.detach(), -0.1 * z.sum() * z, rtol=1e-4, atol=1e-6)


def test_table_is_written_from_a_results_file(tmp_path, capsys):
    import eval_personalization

    results = {
        "date": "2026-11-30", "machine": "x86_64, 2 CPU cores, Linux",
        "config": {"r": 8, "steps": 30, "batch": 8, "lr": 2e-3, "seeds": [0, 1, 2], "dtype": "auto",
                   "mezo_lr": 1e-3},
        "summary": {"nightly": {m: {"accuracy": a, "macro_f1": 0.5, "train_s": 10.0, "steps": 30, "peak_gib": 0.7,
                                    "users": 4} for m, a in (("fp32", 0.8), ("pact", 0.795))}},
        "targets": {"nightly": {
            "pact_vs_fp32": {"points": -0.5, "se": 0.3, "least": -1.0, "met": True, "users": 4},
            "pact_vs_qlora": {"points": -0.2, "se": 0.3, "least": 0.0, "met": False, "users": 4}}},
        "qnn_agreement": {"user": "nightly/built-in", "max_loss_rel_diff": 3e-4, "min_grad_cosine": 0.99998,
                          "steps": [{"grad_rel_error": 0.004}, {"grad_rel_error": 0.0047}]},
    }  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    eval_personalization.main(["--table", str(path)])
    out = capsys.readouterr().out
    assert "| PACT (torch backend) | 79.5% | 0.500 | 10.0 | 30 | 0.70 |" in out
    assert "pact_vs_fp32: -0.5 +/- 0.3 points (target >= -1): met\n" in out  # 0.5 from the target: resolved
    assert "pact_vs_qlora: -0.2 +/- 0.3 points (target >= +0): MISSED (the target is within one SE" in out
    assert "loss within 0.03%, adapter gradients cosine >= 0.999980, relative error <= 0.47%." in out


def test_no_memory_plot_without_memory_figures(tmp_path):
    import personalization_report as report

    rows = {
        m: {"accuracy": a, "train_s": 10.0 + a, "peak_gib": None, "users": 4}
        for m, a in (("fp32", 0.8), ("pact", 0.79))
    }
    results = {"date": "2026-12-05", "machine": "x86_64", "summary": {"nightly": rows}}
    assert report.plot(results, tmp_path) == [str(tmp_path / "accuracy_vs_wallclock.png")]  # --no-memory
    rows["pact"]["peak_gib"] = 0.9
    assert len(report.plot(results, tmp_path)) == 2 and (tmp_path / "accuracy_vs_memory.png").stat().st_size > 0


@pytest.mark.parametrize("native", [True, False])
def test_default_methods_leave_out_emulated_bf16(monkeypatch, capsys, native):
    """Where bf16 is emulated the stock bf16 baseline is 22x slower than fp32 (no user would pick it): the default
    list leaves it out; naming it runs it anyway."""
    import eval_personalization

    from optimum_pact.precision import compute_dtype

    monkeypatch.setattr(compute_dtype, "native_bf16", lambda: native)
    methods = eval_personalization.parse_args([]).methods
    assert [m for m in eval_personalization.METHODS if m not in methods] == ([] if native else ["cpu_bf16"])
    assert ("cpu_bf16 left out" in capsys.readouterr().err) is not native  # said where it is decided
    assert "cpu_bf16" in eval_personalization.parse_args(["--methods", "cpu_bf16", "pact"]).methods
    assert eval_personalization.parse_args(["--methods=pact"]).methods == ["pact"]
    assert "left out" not in capsys.readouterr().err  # naming the methods: nothing left out behind the user's back


def test_lamp_files_go_together():
    import eval_personalization

    with pytest.raises(SystemExit):
        eval_personalization.parse_args(["--lamp-questions", str(FIXTURE / "dev_questions.json")])


def test_heldout_loss_weighs_every_label_token_alike(small_model):
    """The MeZO sweep's score (the main job's held-out loss): mean loss per label token over all items, whatever the
    batching (uneven lengths); the model's training mode is given back."""
    import eval_personalization
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_pact.commands.evaluation import heldout_loss
    from optimum_pact.commands.finetune import tokenize_examples

    tokenizer = AutoTokenizer.from_pretrained(small_model)
    model = AutoModelForCausalLM.from_pretrained(small_model)
    items = [
        {"text": "Tag this: a quiet film about rain", "label": "slow"},
        {"text": "Tag this: robots", "label": "science fiction with long battle scenes"},
        {"text": "Tag this: a heist in Lyon, told backwards by three narrators", "label": "crime"},
    ]
    total, count = 0.0, 0  # the reference: one item at a time, summed over its label tokens
    with torch.no_grad():
        for row in tokenize_examples(tokenizer, items):
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"][1:])
            logits = model(input_ids=ids).logits[0, :-1]
            keep = labels != -100
            total += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
            count += int(keep.sum())
    for batch_size in (1, 2, 3):
        model.train()
        loss = heldout_loss(model, *eval_personalization.tokenized(tokenizer, items), batch_size)
        assert loss == pytest.approx(total / count, rel=1e-5), batch_size
        assert model.training


@pytest.mark.slow
def test_quick_mode_runs_end_to_end(tmp_path):
    """--quick on real SmolLM2 weights and real MovieLens data, plus the LaMP-2 fixture: every method, every user."""
    import eval_personalization

    lamp_args = [
        "--lamp-questions",
        str(FIXTURE / "dev_questions.json"),
        "--lamp-outputs",
        str(FIXTURE / "dev_outputs.json"),
    ]
    results = eval_personalization.main(
        ["--quick", "--output", str(tmp_path), "--workloads", "nightly", "movielens", *lamp_args,
         "--methods", *eval_personalization.METHODS,  # cpu_bf16 too, even where bf16 is emulated: tiny sizes
         "--dtype", "float32"]  # the exactness check below is to fp32's summation order (bf16's is ~1e-2)
    )  # fmt: skip
    assert set(results["workloads"]) == {"nightly", "movielens", "lamp2"}
    assert list(results["workloads"]["lamp2"]["users"]) == ["110"]  # --quick: the first question only
    for workload in results["workloads"].values():
        for user in workload["users"].values():
            assert set(user["methods"]) == set(eval_personalization.METHODS)
            runs = {method: entry["seeds"][0] for method, entry in user["methods"].items()}  # --quick: seed 0 only
            assert all(len(run["predictions"]) == len(user["golds"]) for run in runs.values())
            assert runs["pact"]["steps"] == 2 and runs["mezo"]["steps"] >= 1
            # the exact memory savers train what plain PACT trains (up to float summation order)
            assert runs["pact_exact"]["all_losses"] == pytest.approx(runs["pact"]["all_losses"], rel=1e-4)
    sweep = results["mezo_sweep"]
    assert sweep["swept"] and set(sweep["runs"]) == {1e-4, 3e-4}
    assert sweep["lr"] == min(sweep["runs"], key=lambda lr: sweep["runs"][lr]["heldout_loss"])  # loss picks
    assert all(0 < run["heldout_loss"] < 20 for run in sweep["runs"].values()) and sweep["pact_heldout_loss"] > 0
    assert results["config"]["mezo_lr"] == sweep["lr"] and sweep["user"] == "generated-10000"
    assert set(results["memory"]) == set(eval_personalization.METHODS) - {"majority"}
    memory = {method: m["peak_gib"] for method, m in results["memory"].items()}
    # fp32 LoRA holds 4-byte weights and their gradients' activations: above PACT's NVFP4 base and above forward-only
    # MeZO (no gradients at all); the shared adapter is measured in its own process like every other method
    assert memory["fp32"] > memory["pact"] and memory["fp32"] > memory["mezo"], memory
    assert results["summary"]["nightly"]["shared"]["peak_gib"] == memory["shared"] > 0
    nightly = results["workloads"]["nightly"]["users"]
    pooled_run_s = next(iter(nightly.values()))["methods"]["shared"]["train_s"]  # one run on all users' data
    per_user = results["summary"]["nightly"]["shared"]["train_s"]
    assert per_user == pytest.approx(pooled_run_s / len(nightly)) and len(nightly) > 1
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["targets"]["nightly"]) == {
        "pact_vs_fp32", "pact_vs_mezo_equal_wallclock", "pact_vs_qlora", "pact_exact_vs_fp32"
    }  # fmt: skip
    assert "| PACT + memory savers (exact) |" in (tmp_path / "results.md").read_text()
    assert all(Path(p).stat().st_size > 0 for p in results["plots"]) and len(results["plots"]) == 2


def _run(accuracy: float) -> dict:
    return {"accuracy": accuracy, "f1": accuracy, "predictions": ["a"], "train_s": 1.0, "steps": 2}


def test_resume_keeps_finished_runs_and_saves_after_each_user(tmp_path):
    """An interrupted run: user `u1` finished both seeds, `u2` none. Resuming redoes nothing `u1` has (no model is
    built for it: there is none here), and the partial results.json already summarizes what was run."""
    from types import SimpleNamespace

    import eval_personalization
    import personalization_report

    args = eval_personalization.parse_args(["--output", str(tmp_path), "--seeds", "0", "1", "--resume"])
    config = {k: v for k, v in vars(args).items() if k not in ("table", "output")}
    u1 = {m: {"seeds": {"0": _run(0.5), "1": _run(0.7)}} for m in ("fp32", "pact")}
    for run in u1["pact"]["seeds"].values():
        run["nvfp4_scale_rule"] = eval_personalization.scale_rule()  # in use: kept (another is redone: next test)
    saved = {"config": config, "workloads": {"nightly": {"users": {"u1": {"methods": u1}}}}}
    (tmp_path / "results.json").write_text(json.dumps(saved))
    previous = eval_personalization.resumed(args, tmp_path)
    kept = previous["workloads"]["nightly"]["users"]
    assert set(kept["u1"]["methods"]["pact"]["seeds"]) == {0, 1}  # JSON's string keys back to the seeds

    task = SimpleNamespace(user="u1", train=[], test=[{"label": "a"}], labels=("a",))
    seen = []
    workload = eval_personalization.run_workload("nightly", [task], "no-model", None, args, ["fp32", "pact"], kept,
                                                 on_user=seen.append)  # fmt: skip
    assert seen == []  # nothing left to run for u1
    assert workload["users"]["u1"]["methods"]["pact"]["accuracy"] == pytest.approx(0.6)

    partial = {"workloads": {"nightly": {"users": {"u1": workload["users"]["u1"], "u2": {"methods": {
        m: {"seeds": {}, "accuracy": None, "f1": None} for m in ("fp32", "pact")}}}}}}  # fmt: skip
    personalization_report.summarize(partial)
    assert partial["summary"]["nightly"]["pact"]["users"] == 1  # u2 has not run yet
    assert partial["targets"]["nightly"]["pact_vs_fp32"]["users"] == 1
    partial.update(config=config, date="2026-12-02", machine="x86_64", complete=False)
    table = personalization_report.markdown_table(partial)
    assert "PARTIAL: an interrupted run (2 of 4 user-seeds)" in table
    partial["config"] = {**config, "seeds": [0, 1, 2]}  # a sitting that asked for seed 2 and stopped before it
    assert ", seeds [0, 1], " in personalization_report.markdown_table(partial)  # the seeds that ran
    partial["pieces"] = [{"date": "2026-12-02", "machine": "EPYC; avx512_bf16=False"},
                         {"date": "2026-12-03", "machine": "EPYC; avx512_bf16=True"}]  # fmt: skip
    header = personalization_report.markdown_table(partial).splitlines()[0]
    assert "2026-12-02 on EPYC; avx512_bf16=False and 2026-12-03 on EPYC; avx512_bf16=True;" in header


def test_resume_adds_seeds_to_some_methods_and_pairs_over_the_seeds_both_ran(tmp_path, monkeypatch):
    """A finished 1-seed run of fp32, pact and mezo, resumed with a second seed for fp32 and pact only: only those two
    run (seed 1), mezo's run is carried over, and each comparison pairs per user over the seeds both methods ran."""
    from types import SimpleNamespace

    import eval_personalization
    import personalization_report

    first = eval_personalization.parse_args(["--seeds", "0", "--methods", "fp32", "pact", "mezo"])
    config = {k: v for k, v in vars(first).items() if k not in ("table", "output")}
    u1 = {m: {"seeds": {"0": _run(a)}} for m, a in (("fp32", 0.5), ("pact", 0.6), ("mezo", 0.2))}
    u1["pact"]["seeds"]["0"]["nvfp4_scale_rule"] = eval_personalization.scale_rule()
    (tmp_path / "results.json").write_text(json.dumps({"config": config, "workloads": {"nightly": {"users": {
        "u1": {"methods": u1}}}}}))  # fmt: skip
    argv = ["--output", str(tmp_path), "--resume", "--seeds", "0", "1", "--methods", "fp32", "pact"]
    args = eval_personalization.parse_args(argv)
    kept = eval_personalization.resumed(args, tmp_path)["workloads"]["nightly"]["users"]  # other seeds and methods
    ran = []
    monkeypatch.setattr(eval_personalization, "batches", lambda *a: [])
    accuracy = {"fp32": 0.9, "pact": 0.8}
    monkeypatch.setattr(eval_personalization, "run_method",
                        lambda method, *a, **k: ran.append((method, a[-1])) or _run(accuracy[method]))  # fmt: skip
    task = SimpleNamespace(user="u1", train=[], test=[{"label": "a"}], labels=("a",))
    workload = eval_personalization.run_workload("nightly", [task], "no-model", None, args, ["fp32", "pact"], kept)
    assert ran == [("fp32", 1), ("pact", 1)]
    methods = workload["users"]["u1"]["methods"]
    assert list(methods) == ["fp32", "pact", "mezo"] and set(methods["mezo"]["seeds"]) == {0}
    results = {"workloads": {"nightly": workload}, "config": {**config, "seeds": [0, 1]}, "date": "2026-12-03",
               "machine": "x86_64"}  # fmt: skip
    personalization_report.summarize(results)
    targets = results["targets"]["nightly"]
    # pact - fp32: seed 0 +10, seed 1 -10: 0 over 2 pairs; pact - mezo: seed 0 only, +40 (not pact's 2-seed mean)
    assert targets["pact_vs_fp32"]["points"] == pytest.approx(0) and targets["pact_vs_fp32"]["pairs"] == 2
    assert targets["pact_vs_mezo_equal_wallclock"]["points"] == pytest.approx(40)
    assert targets["pact_vs_mezo_equal_wallclock"]["pairs"] == 1
    table = personalization_report.markdown_table(results)
    assert "mean over its seeds: 2 for fp32, pact; 1 for the others)" in table
    assert "pact_vs_fp32: +0.0 points (target >= -1, 1 users, 2 paired runs): met" in table
    with pytest.raises(SystemExit, match="'steps'"):  # the other settings must still be the saved ones
        eval_personalization.resumed(eval_personalization.parse_args([*argv, "--steps", "5"]), tmp_path)


def test_resume_refuses_results_of_other_settings(tmp_path):
    import eval_personalization

    saved = eval_personalization.parse_args(["--steps", "30"])
    config = {k: v for k, v in vars(saved).items() if k not in ("table", "output")}
    (tmp_path / "results.json").write_text(json.dumps({"config": config, "workloads": {}}))
    with pytest.raises(SystemExit, match="'steps': \\(30, 20\\)"):
        eval_personalization.resumed(eval_personalization.parse_args(["--steps", "20", "--resume"]), tmp_path)
    assert eval_personalization.resumed(eval_personalization.parse_args(["--steps", "20"]), tmp_path) == {}


def test_resume_compares_the_dtype_auto_resolved_to(tmp_path, monkeypatch):
    """`auto` was fp32 on the CPU of the first sitting and is bf16 on this one: resuming would mix bf16 runs into
    an fp32 table, so it is refused naming compute_dtype; `--dtype float32` resumes it."""
    import eval_personalization

    from optimum_pact.precision import compute_dtype

    monkeypatch.setattr(compute_dtype, "native_bf16", lambda: False)
    saved = eval_personalization.parse_args(["--methods", "fp32", "pact"])
    config = {k: v for k, v in vars(saved).items() if k not in ("table", "output")}
    assert config["compute_dtype"] == "float32"
    (tmp_path / "results.json").write_text(json.dumps({"config": config, "workloads": {}}))
    monkeypatch.setattr(compute_dtype, "native_bf16", lambda: True)
    now = ["--methods", "fp32", "pact", "--output", str(tmp_path), "--resume"]
    with pytest.raises(SystemExit, match=r"'compute_dtype': \('float32', 'bfloat16'\)"):
        eval_personalization.resumed(eval_personalization.parse_args(now), tmp_path)
    assert eval_personalization.resumed(eval_personalization.parse_args([*now, "--dtype", "float32"]), tmp_path)


def test_resume_redoes_the_runs_on_the_nvfp4_base_made_under_another_scale_rule(tmp_path, monkeypatch):
    """The default NVFP4 scale rule changed ("6" -> "4/6" -> "mse"): a resumed run keeps fp32's runs, redoes PACT's
    (saved without a rule: "6"), records the rule on the new ones, and the table header says which rules the runs
    used."""
    from types import SimpleNamespace

    import eval_personalization
    import personalization_report

    args = eval_personalization.parse_args(["--output", str(tmp_path), "--seeds", "0", "--resume"])
    config = {k: v for k, v in vars(args).items() if k not in ("table", "output")}
    u1 = {m: {"seeds": {"0": _run(0.5)}} for m in ("fp32", "pact")}
    (tmp_path / "results.json").write_text(json.dumps({"config": config, "workloads": {"nightly": {"users": {
        "u1": {"methods": u1}}}}}))  # fmt: skip
    kept = eval_personalization.resumed(args, tmp_path)["workloads"]["nightly"]["users"]
    ran = []
    monkeypatch.setattr(eval_personalization, "batches", lambda *a: [])
    monkeypatch.setattr(eval_personalization, "run_method", lambda method, *a, **k: ran.append(method) or _run(0.9))
    task = SimpleNamespace(user="u1", train=[], test=[{"label": "a"}], labels=("a",))
    workload = eval_personalization.run_workload("nightly", [task], "no-model", None, args, ["fp32", "pact"], kept)
    assert ran == ["pact"]
    methods = workload["users"]["u1"]["methods"]
    assert methods["fp32"]["accuracy"] == 0.5 and methods["pact"]["accuracy"] == 0.9
    rule = eval_personalization.scale_rule()
    assert methods["pact"]["seeds"][0]["nvfp4_scale_rule"] == rule and "nvfp4_scale_rule" not in methods["fp32"]
    results = {"workloads": {"nightly": workload}, "config": config, "date": "2026-12-03", "machine": "x86_64"}
    personalization_report.summarize(results)
    assert f"NVFP4 scale rule {rule}." in personalization_report.markdown_table(results).splitlines()[0]
    methods["pact_exact"] = {"seeds": {0: _run(0.8)}, "accuracy": 0.8, "f1": 0.8}  # not redone yet: "6"
    assert f"NVFP4 scale rule {rule} (6: 1 runs)." in personalization_report.markdown_table(results).splitlines()[0]
    # a memory probe or qnn check under "6" stands no more either; fp32's does
    assert not eval_personalization.stands("pact", {"peak_gib": 1.0})
    assert eval_personalization.stands("pact", {"peak_gib": 1.0, "nvfp4_scale_rule": rule})
    assert not eval_personalization.stands("pact", {"peak_gib": 1.0, "nvfp4_scale_rule": "4/6"})
    assert eval_personalization.stands("fp32", {"peak_gib": 1.0})
