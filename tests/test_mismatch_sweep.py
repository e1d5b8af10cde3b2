"""The depth sweep of the mismatch probe: its guidance per depth, its resume, its figures and
refusals, and (slow) one quick sweep end to end."""

import json
import os

import pytest

from experiments import mismatch_sweep as sweep


def test_guidance_per_depth_names_each_share_once():
  assert sweep.guidances(2) == [("none", "none"), ("last:1", "last:1"), ("all", "all")]
  assert sweep.guidances(4) == [("none", "none"), ("last:1", "last:1"), ("last:2", "L/2"),
                                ("all", "all")]
  assert sweep.guidances(32) == [("none", "none"), ("last:1", "last:1"), ("last:8", "L/4"),
                                 ("last:16", "L/2"), ("all", "all")]


def _rows(depths=(2, 4)):
  rows = []
  for n in depths:
    for spec, share in sweep.guidances(n):
      for replay in (False, True):
        kl = 0.0 if spec == "all" else 1e-3 * n
        rows.append({"layers": n, "rollout_quant": "mxfp4", "records": spec,
                     "records_of": share, "routing_replay": replay, "mismatch/kl_k3": kl,
                     "mismatch/flip_rate": kl * 10, "mismatch/kl_k3_by_position": [kl, None, kl]})
  return rows


def test_figures_only_draws_from_the_rows_alone_and_refuses_without_them(tmp_path, capsys):
  out = tmp_path / "sweep"
  with pytest.raises(SystemExit, match="rows.jsonl: no rows"):
    sweep.main([f"--out={out}", "--figures_only"])
  with open(out / sweep.ROWS, "w") as fh:
    fh.writelines(json.dumps(r) + "\n" for r in _rows())
  sweep.main([f"--out={out}", "--figures_only"])
  for name in sweep.FIGURES:
    assert os.path.getsize(out / name) > 1000, name
  table = capsys.readouterr().out
  assert "| 4 | mxfp4 | last:2 | on | 4.00e-03 | 0.0400 | 4.0e-03 -> 4.0e-03 |" in table


def _fake_sweep_depth(ran):
  def sweep_depth(args, n, precision, log=print):
    ran.append((n, precision))
    return [dict(r, layers=n, rollout_quant=precision) for r in _rows((n,))]
  return sweep_depth


def test_a_depth_already_swept_is_not_run_again(tmp_path, monkeypatch):
  out = tmp_path / "sweep"
  out.mkdir()
  with open(out / sweep.ROWS, "w") as fh:
    fh.writelines(json.dumps(r) + "\n" for r in _rows((2,)))
  ran = []
  monkeypatch.setattr(sweep, "sweep_depth", _fake_sweep_depth(ran))
  sweep.main([f"--out={out}", "--depths=2,4", "--precisions=mxfp4"])
  assert ran == [(4, "mxfp4")]
  assert {r["layers"] for r in sweep.read_rows(str(out))} == {2, 4}


def test_a_sweep_stopped_between_precisions_resumes_at_the_missing_one(tmp_path, monkeypatch):
  """Each (depth, precision) is written when it finishes: a stop during a depth's second
  precision keeps the first, and the rerun probes only what is missing."""
  out = tmp_path / "sweep"
  out.mkdir()
  with open(out / sweep.ROWS, "w") as fh:  # depth 2 had its mxfp4 rows when the run stopped
    fh.writelines(json.dumps(r) + "\n" for r in _rows((2,)))
  ran = []
  monkeypatch.setattr(sweep, "sweep_depth", _fake_sweep_depth(ran))
  sweep.main([f"--out={out}", "--depths=2,4", "--precisions=mxfp4,nvfp4"])
  assert ran == [(2, "nvfp4"), (4, "mxfp4"), (4, "nvfp4")]
  rows = sweep.read_rows(str(out))
  assert {(r["layers"], r["rollout_quant"]) for r in rows} == {
      (2, "mxfp4"), (2, "nvfp4"), (4, "mxfp4"), (4, "nvfp4")}
  assert len(rows) == 2 * (len(_rows((2,))) + len(_rows((4,))))


def test_rows_name_their_engine_and_one_directory_holds_one_engine(tmp_path, monkeypatch,
                                                                    capsys):
  """Each row says which rollout kernels produced it; a sweep on other kernels than the rows
  already in --out is refused before any work (rows of older sweeps, without the key, are
  XLA's), so one directory's figures never mix engines."""
  out = tmp_path / "sweep"
  ran = []
  fake = _fake_sweep_depth(ran)
  monkeypatch.setattr(sweep, "sweep_depth",
                      lambda args, n, p, log=print: [dict(r, kernels=args.kernels)
                                                     for r in fake(args, n, p, log)])
  sweep.main([f"--out={out}", "--depths=2", "--precisions=mxfp4", "--kernels=pallas"])
  assert {r["kernels"] for r in sweep.read_rows(str(out))} == {"pallas"}
  with pytest.raises(SystemExit):
    sweep.main([f"--out={out}", "--depths=2,4", "--precisions=mxfp4"])
  assert "holds rows of the pallas engine" in capsys.readouterr().err
  assert ran == [(2, "mxfp4")]
  old = tmp_path / "old"
  old.mkdir()
  with open(old / sweep.ROWS, "w") as fh:  # rows without the key
    fh.writelines(json.dumps(r) + "\n" for r in _rows((2,)))
  with pytest.raises(SystemExit):
    sweep.main([f"--out={old}", "--depths=2", "--kernels=pallas"])
  assert "holds rows of the xla engine" in capsys.readouterr().err


@pytest.mark.parametrize("flag,message", [
    ("--depths=4,x", "--depths='4,x'"), ("--depths=0,4", "every depth must be >= 1"),
    ("--family=nope", "no configs/nope.py"), ("--max_new_tokens=0", "--max_new_tokens must be"),
    ("--precisions=mxfp4,fp3", "--precisions='mxfp4,fp3': comma-separated rollout precisions")])
def test_bad_arguments_are_named(tmp_path, capsys, flag, message):
  with pytest.raises(SystemExit):
    sweep.main([f"--out={tmp_path}", flag])
  assert message in capsys.readouterr().err


@pytest.mark.slow  # ~3 minutes: two warm starts and two probes
def test_quick_sweep_end_to_end(tmp_path):
  out = tmp_path / "sweep"
  sweep.main([f"--out={out}", "--quick"])
  rows = sweep.read_rows(str(out))
  assert {(r["layers"], r["records_of"]) for r in rows} == {
      (2, "none"), (2, "last:1"), (2, "all"), (4, "none"), (4, "last:1"), (4, "L/2"), (4, "all")}
  for r in rows:
    assert len(r["mismatch/kl_k3_by_position"]) == sweep.QUICK["n_buckets"]
    assert r["rollout/response_tokens"] == sweep.QUICK["batch"] * sweep.QUICK["max_new_tokens"]
    if r["records"] == "all":  # every layer recorded: the trainer rounds as the rollout did
      assert r["mismatch/flip_rate"] == 0.0, r
    else:
      assert r["mismatch/flip_rate"] > 0.0, r
  for name in sweep.FIGURES:
    assert os.path.getsize(out / name) > 1000, name


def test_the_committed_h200_sweep_redraws_from_its_rows(tmp_path):
  """experiments/results/mismatch_sweep_h200: its figures are the ones --figures_only draws
  from its rows.jsonl alone; records=all with routing replay flipped no code up to 8 layers and
  at most a few in 10^8 at 16 and 32 (RESULTS.md: values the two paths' summation orders move
  across a power of two, which a one-bit record cannot pin)."""
  committed = os.path.join(sweep.ROOT, "experiments", "results", "mismatch_sweep_h200")
  rows = sweep.read_rows(committed)
  assert rows, committed
  assert sorted(f for f in os.listdir(committed) if f.endswith(".png")) == sorted(sweep.FIGURES)
  out = tmp_path / "redraw"
  out.mkdir()
  with open(out / sweep.ROWS, "w") as fh:
    fh.writelines(json.dumps(r) + "\n" for r in rows)
  sweep.main([f"--out={out}", "--figures_only"])
  for name in sweep.FIGURES:
    assert os.path.getsize(out / name) > 1000, name
  replayed_all = [r for r in rows if r["records"] == "all" and r["routing_replay"]]
  assert {r["layers"] for r in replayed_all} == {4, 8, 16, 32}
  assert all(r["mismatch/flip_rate"] == 0.0 for r in replayed_all if r["layers"] <= 8)
  assert all(r["mismatch/flip_rate"] < 3e-8 for r in replayed_all)


def test_position_figure_takes_each_precisions_own_deepest_depth(tmp_path):
  """A precision swept to fewer depths than another still gets its panel (its own deepest
  depth), whichever precision sorts first."""
  import warnings
  rows = ([dict(r, rollout_quant="mxfp4") for r in _rows((2,))]
          + [dict(r, rollout_quant="nvfp4") for r in _rows((2, 4))])
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an empty panel warns (a legend with nothing in it)
    paths = sweep.draw(rows, str(tmp_path))
  assert sorted(os.path.basename(p) for p in paths) == sorted(sweep.FIGURES)
  assert sweep.deepest(rows, "mxfp4") == 2 and sweep.deepest(rows, "nvfp4") == 4
