"""benchmarks/studies/acco_study.py and benchmarks/studies/seed_table.py on the tiny preset / on small CSVs."""
import csv
import importlib.util
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", "studies", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--model", "tiny", "--ctx", "32", "--updates", "6", "--eval-points", "6", "--val-windows", "4", "--quiet"]


def _evals(method, extra=()):
    study = _load("acco_study")
    result = study.run(study.parse_args(["--method", method] + TINY + list(extra)))
    return [v for _, v in sorted(result["evals"].items(), key=lambda kv: int(kv[0]))], result


def test_acco_study_zero1_is_the_co2_study_zero1_and_acco_departs_after_one_update():
    zero1, _ = _evals("zero1")
    co2_study = _load("co2_study")
    other = co2_study.run(co2_study.parse_args(["--method", "zero1"] + TINY))
    assert zero1 == pytest.approx([v["committed"] for _, v in sorted(other["evals"].items(),
                                                                        key=lambda kv: int(kv[0]))], abs=1e-5)
    acco, result = _evals("acco")
    stale, _ = _evals("stale-half")
    # theta~_0 = theta_0 = theta_{-1}: the first update is ZeRO-1's for every rule; later ones are not.
    assert acco[:2] == pytest.approx(zero1[:2], abs=1e-6) and stale[:2] == pytest.approx(zero1[:2], abs=1e-6)
    assert acco[-1] != pytest.approx(zero1[-1], abs=1e-6) and stale[-1] != pytest.approx(acco[-1], abs=1e-6)
    errors = result["estimate_error"]
    assert len(errors) == 6 and all(e["error"] > 0 and e["step"] > 0 for e in errors)
    # The gradient probe re-reads the first half's micro-batches at theta_t and leaves the run unchanged.
    probed, presult = _evals("acco", ["--probe-every", "2"])
    assert probed == acco and presult["estimate_error"] == errors
    assert [p["update"] for p in presult["gradient_probe"]] == [2, 4]
    for p in presult["gradient_probe"]:
        assert p["displacement"] == pytest.approx(errors[p["update"] - 1]["error"])
        assert p["gradient_error"] > 0 and p["half_noise"] > 0
        assert p["error_over_noise"] == pytest.approx(p["gradient_error"] / p["half_noise"])


def test_acco_study_compressed_wire_keeps_what_it_does_not_send():
    study = _load("acco_study")
    torch.manual_seed(0)
    values = torch.randn(300) * 3
    sent = study.quantize_blocks(values, 4, 128)
    scale = torch.nn.functional.pad(values, (0, 84)).view(-1, 128).abs().amax(dim=1) / 7
    assert ((values - sent).abs().view(-1)[:256].view(2, 128) <= scale[:2, None] / 2 * (1 + 1e-6)).all()
    assert len(set(sent[:128].tolist())) <= 15  # int4: at most 15 levels per block
    # Error feedback: over several calls, what the owners received plus the residuals is what was put in.
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        reduce = study.CompressedReduce(301, 2, 4, 128, dtype)
        sums = [torch.randn(301), torch.randn(301)]
        received = sum(reduce(sums) for _ in range(5))
        padded = torch.nn.functional.pad(5 * (sums[0] + sums[1]), (0, 1))
        left = reduce.residuals[0].float() + reduce.residuals[1].float()
        assert torch.allclose(received + left[:301], padded[:301], atol=tolerance)
        assert reduce.residuals[0].dtype == dtype and reduce.residuals[0][:151].abs().sum() == 0  # own chunk
    # The wire changes the run, the residual's dtype changes it less than int4 does.
    exact, _ = _evals("acco")
    fp32, _ = _evals("acco", ["--wire", "int4"])
    bf16, _ = _evals("acco", ["--wire", "int4", "--residual", "bf16"])
    assert fp32[0] == exact[0] and fp32[-1] != exact[-1] and bf16[-1] != fp32[-1]
    assert abs(bf16[-1] - fp32[-1]) < abs(fp32[-1] - exact[-1])


def _write_steps(folder, rows):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "steps.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["bandwidth", "method", "seed", "rank", "update", "val_loss"])
        for method, seed, update, loss in rows:
            writer.writerow(["unshaped", method, seed, 0, update, loss])
            writer.writerow(["unshaped", method, seed, 1, update, loss + 1])  # rank 1 is never read


def test_seed_table_gaps_per_seed_ranges_and_lone_replica(tmp_path, capsys):
    _write_steps(tmp_path / "a", [("zero1", 0, 0, 5.0), ("zero1", 0, 10, 2.0), ("zero1", 0, 20, 1.0),
                                  ("compute", 0, 0, 5.0), ("compute", 0, 10, 2.1), ("compute", 0, 20, 1.5),
                                  ("co2", 0, 0, 5.0), ("co2", 0, 10, 2.2), ("co2", 0, 20, 1.1)])
    _write_steps(tmp_path / "b", [("zero1", 1, 0, 5.0), ("zero1", 1, 10, 2.0), ("zero1", 1, 20, 2.0),
                                  ("co2", 1, 0, 5.0), ("co2", 1, 10, 2.5), ("co2", 1, 20, 2.6),
                                  ("co2", 0, 20, 9.9)])  # a second run of seed 0: the first folder wins
    assert _load("seed_table").main([str(tmp_path / "a"), str(tmp_path / "b"), "--methods", "zero1,co2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    co2 = next(line for line in lines if line.startswith("| CO2"))
    cells = [c.strip() for c in co2.strip("|").split("|")]
    # seeds, @10, @20, gap @20 (seed 0: +10%, seed 1: +30%), decreasing, above the lone replica
    assert cells[1:] == ["0,1", "2.350 [2.200, 2.500]", "1.850 [1.100, 2.600]", "+20.0% [+10.0%, +30.0%]",
                         "1 of 2", "seed 0: 1 (10); seed 1: no lone run"]
    # FOLDER@TAG: a variant's rows are kept apart from the same method's plain runs; its baseline
    # and lone replica rows are the plain ones (the first folder still wins for those).
    _write_steps(tmp_path / "c", [("zero1", 0, 0, 5.0), ("zero1", 0, 10, 7.0), ("zero1", 0, 20, 7.0),
                                  ("co2", 0, 0, 5.0), ("co2", 0, 10, 1.9), ("co2", 0, 20, 0.9)])
    assert _load("seed_table").main([str(tmp_path / "c") + "@local_steps 4", str(tmp_path / "a")]) == 0
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in capsys.readouterr().out.splitlines()[2:])}
    assert list(rows) == ["lone replica (no communication)", "DeepSpeed ZeRO-1", "CO2 (defaults)",
                          "CO2 (defaults), local_steps 4"]
    assert rows["DeepSpeed ZeRO-1"][:3] == ["0", "7.000", "7.000"]  # the first folder's zero1 run
    assert rows["CO2 (defaults), local_steps 4"][:4] == ["0", "1.900", "0.900", "-87.1%"]
    assert rows["CO2 (defaults)"][:4] == ["0", "2.200", "1.100", "-84.3%"]
    # FOLDER@METHODS=TAG tags only the methods named: here co2, while the folder's acco stays plain.
    _write_steps(tmp_path / "d", [("zero1", 2, 0, 5.0), ("zero1", 2, 10, 2.0), ("zero1", 2, 20, 1.0),
                                  ("acco", 2, 0, 5.0), ("acco", 2, 10, 2.0), ("acco", 2, 20, 1.2),
                                  ("co2", 2, 0, 5.0), ("co2", 2, 10, 2.0), ("co2", 2, 20, 1.05)])
    assert _load("seed_table").main([str(tmp_path / "d") + "@co2=local_steps 4", str(tmp_path / "a"),
                                     "--methods", "zero1,acco,co2,co2@local_steps 4"]) == 0
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in capsys.readouterr().out.splitlines()[2:])}
    assert rows["ACCO"][:4] == ["2", "2.000", "1.200", "+20.0%"]
    assert rows["CO2 (defaults), local_steps 4"][:4] == ["2", "2.000", "1.050", "+5.0%"]
    assert rows["CO2 (defaults)"][0] == "0"  # only folder a's plain co2 run
    # --update-ratio: seed 2's ZeRO-1 reaches acco's 1.2 at update 18 (2.0 -> 1.0 over 10..20), 0.9 of 20;
    # co2's 1.05 at 19.5; nothing reaches a loss below the baseline's best.
    assert _load("seed_table").main([str(tmp_path / "d") + "@co2=local_steps 4", "--gaps", "20",
                                     "--update-ratio"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "zero1 updates to its loss / 20" in lines[0]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert rows["ACCO"][3:5] == ["+20.0%", "0.90"] and rows["CO2 (defaults), local_steps 4"][4] == "0.97"
    _write_steps(tmp_path / "e", [("zero1", 4, 0, 5.0), ("zero1", 4, 10, 2.0), ("acco", 4, 0, 5.0), ("acco", 4, 10, 1.5)])
    assert _load("seed_table").main([str(tmp_path / "e"), "--update-ratio"]) == 0
    assert "- (1 not reached)" in capsys.readouterr().out


def test_acco_study_keeps_fp32_masters_with_bf16_gradients():
    study = _load("acco_study")
    from deepspeed_acco.bench.workload.data import load_corpus
    model = study.Model(study.parse_args(["--method", "zero1", "--bf16"] + TINY), load_corpus(None))
    assert model.flat().dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.params)


def test_position_loss_reads_saved_vectors_and_agrees_with_the_study_evaluation(tmp_path, capsys):
    import json
    from deepspeed_acco.bench.workload.data import load_corpus
    study = _load("acco_study")
    saved = tmp_path / "zero1.pt"
    args = study.parse_args(["--method", "zero1"] + TINY + ["--save-final", str(saved)])
    result = study.run(args)
    final = result["evals"]["6"]
    initial = tmp_path / "initial.pt"
    torch.save(study.Model(args, load_corpus(None)).flat(), initial)
    out = tmp_path / "pos.json"
    assert _load("position_loss").main(["--model", "tiny", "--ctx", "32", "--windows", "4", "--bands", "0,8,16",
                                        f"trained={saved}", f"same={saved}", f"initial={initial}",
                                        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["windows"] == 4 and report["bands"] == ["0-7", "8-15", "16-30"]
    trained = report["runs"]["trained"]
    # The same held-out windows as the study's evaluator: the same mean loss.
    assert trained["all"]["loss"] == pytest.approx(final, rel=1e-5)
    # Bands of 8, 8 and 15 predicted bytes: their weighted mean is the whole window's.
    assert (8 * trained["0-7"]["loss"] + 8 * trained["8-15"]["loss"] + 15 * trained["16-30"]["loss"]) / 31 == \
        pytest.approx(trained["all"]["loss"], rel=1e-6)
    assert report["runs"]["same"]["all"]["gap"] == 0.0 and report["runs"]["same"]["all"]["gap_se"] == 0.0
    assert report["runs"]["initial"]["all"]["gap"] > 0  # six updates lower the loss of the initial weights
    assert "trained" in capsys.readouterr().out


def test_delay_stability_edges_match_the_closed_forms():
    # docs/studies/dpu_convergence.md: with momentum beta1, synchronous AdamW (frozen preconditioner) is
    # stable up to lr*h = 2 (1 + beta1) / (1 - beta1), DPU's one-update-stale gradient only up to 1
    # whatever beta1 is, and ACCO's half-batch estimate in between, at 2 / (1 - beta1): its
    # eigenvalues are the synchronous ones and the estimate error's factor -(1 - beta1) lr h / 2.
    import numpy as np
    stab = _load("delay_stability")
    for beta in (0.0, 0.5, 0.9, 0.99):
        sync, dpu, acco = (stab.edge(rule, beta) for rule in ("sync", "dpu", "acco"))
        assert sync == pytest.approx(2 * (1 + beta) / (1 - beta), rel=1e-6), beta
        assert dpu == pytest.approx(1.0, rel=1e-6), beta
        assert acco == pytest.approx(2 / (1 - beta), rel=1e-6), beta
        a = 0.7 * acco
        acco_eigs = sorted(np.linalg.eigvals(stab.transition("acco", beta, a)), key=lambda z: (z.real, z.imag))
        want = sorted(list(np.linalg.eigvals(stab.transition("sync", beta, a))) + [-(1 - beta) * a / 2],
                      key=lambda z: (z.real, z.imag))
        np.testing.assert_allclose(acco_eigs, want, atol=1e-9)
        # Just inside the edge the error shrinks, just outside it grows.
        for rule, a in (("sync", sync), ("dpu", dpu), ("acco", acco)):
            assert stab.spectral_radius(rule, beta, 0.99 * a) < 1 < stab.spectral_radius(rule, beta, 1.01 * a), rule
    # Extrapolating the stale point by k = 0 is DPU itself; at beta1 0.9 even k = 1 stays far below sync.
    assert stab.edge("dpu-extrapolated", 0.9, k=0.0) == pytest.approx(1.0, rel=1e-6)
    assert 2.6 < stab.edge("dpu-extrapolated", 0.9, k=1.0) < 2.8
    with pytest.raises(ValueError, match="unknown rule 'zero3'"):
        stab.transition("zero3", 0.9, 1.0)


def test_seed_table_paired_gaps_per_seed_with_a_t_interval(tmp_path, capsys):
    table = _load("seed_table")
    rows = []
    for seed, (ref, q) in enumerate([(2.0, 2.02), (2.0, 1.98), (1.0, 1.01), (4.0, 4.0)]):
        rows += [("acco+bf16comm", seed, 0, 5.0), ("acco+bf16comm", seed, 10, ref),
                 ("acco+q8", seed, 0, 5.0), ("acco+q8", seed, 10, q)]
    rows += [("zero1", 0, 10, 9.0), ("co2+q4", 0, 10, 3.0)]  # a pair needs both of a seed: seed 0 only
    _write_steps(tmp_path / "a", rows)
    _write_steps(tmp_path / "b", [("co2+fp32comm", 0, 10, 2.5), ("co2+fp32comm", 1, 10, 2.0)])
    assert table.main([str(tmp_path / "a"), str(tmp_path / "b"),
                       "--paired", "acco+q8=acco+bf16comm, co2+q4=co2+fp32comm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| method | against | seeds | per seed @10 | mean, 95% interval @10 |"
    acco = [c.strip() for c in lines[2].strip("|").split("|")]
    # +1%, -1%, +1%, 0%: mean +0.25%, sd 0.957, half-width 3.182 * 0.957 / 2 = 1.52
    assert acco == ["ACCO, int8 wire", "ACCO, bf16 wire", "0,1,2,3", "+1.00%, -1.00%, +1.00%, +0.00%",
                    "+0.25% [-1.27, +1.77]"]
    co2 = [c.strip() for c in lines[3].strip("|").split("|")]
    assert co2 == ["CO2, int4 averaging", "CO2, fp32 averaging", "0", "+20.00%", "+20.00%"]
    with pytest.raises(SystemExit):
        table.main([str(tmp_path / "a"), "--paired", "acco+q8"])
    assert "expected METHOD=REFERENCE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        table.main([str(tmp_path / "a"), "--paired", "acco+q4=acco+bf16comm"])
    assert "no runs of acco+q4" in capsys.readouterr().err
