"""A careful user's battery: bad inputs that used to fail only after the ranks started, or ran
something other than asked, or were refused with words that did not help -- each now one
``error:`` line naming the setting before anything starts -- and the valid forms next to
them, which must still be accepted.

In process through the CLI's own checks (``cli.check_args``: the command line, composition,
the config, the plan, pre-flight of every point) with ``launch.spawn`` and ``subprocess``
patched to fail the test if anything starts; a few real ``python run.py`` runs show the same
in the real CLI. ``test_battery`` tallies the battery: refused up front / accepted
(late or silent) / valid refused; the goal is every bad input up front and no valid one
refused.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import REPO
from zero_repro.lab import cli, launcher
from zero_repro.runtime.comm import launch
from zero_repro.runtime.comm.cpu import shm
from zero_repro.runtime.train import checkpoint

BIG_TOKENS = 256_000_000 + 4096  # past the size the vocabulary scan used to skip


def _checkpoint(path, step: int, payload: bytes = b"shard bytes") -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "shard_0.distcp"), "wb") as f:
        f.write(payload)
    doc = {"format": checkpoint.FORMAT, "step": step, "tp": 1, "params": {},
           "files": {"shard_0.distcp": hashlib.sha256(payload).hexdigest()}, "extra": {}}
    with open(os.path.join(path, checkpoint.MANIFEST), "w") as f:
        f.write(checkpoint.files.sealed(doc))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("careful_user")
    ids = np.arange(1000, dtype=np.uint16) % 256  # in every vocabulary used here
    ids.tofile(d / "ok.bin")
    with open(d / "odd.bin", "wb") as f:
        f.write(ids.tobytes() + b"\x01")
    with open(d / "big.bin", "wb") as f:  # sparse: zeros, then one id past the vocabulary
        f.seek(2 * (BIG_TOKENS - 1))
        f.write(np.array([60000], dtype=np.uint16).tobytes())
    ids.tofile(d / "données.bin")
    flipped = _checkpoint(d / "flipped" / "step_00000002", 2)
    with open(os.path.join(flipped, "shard_0.distcp"), "r+b") as f:
        f.write(b"X")
    missing = _checkpoint(d / "missing" / "step_00000002", 2)
    os.remove(os.path.join(missing, "shard_0.distcp"))
    _checkpoint(d / "auto" / "step_00000002", 2)
    newest = _checkpoint(d / "auto" / "step_00000004", 4)
    with open(os.path.join(newest, "shard_0.distcp"), "r+b") as f:
        f.write(b"X")
    with open(d / "auto" / "latest", "w") as f:
        f.write("step_00000004\n")
    _checkpoint(d / "all_bad" / "step_00000004", 4)
    with open(d / "all_bad" / "step_00000004" / "shard_0.distcp", "r+b") as f:
        f.write(b"X")
    return {k: str(d / k) for k in ("ok.bin", "odd.bin", "big.bin", "données.bin", "auto",
                                   "all_bad")} | {"flipped": flipped, "missing": missing}


@pytest.fixture
def nothing_starts(monkeypatch):
    from zero_repro import schema

    schema.register_configs()  # what cli.main does before it composes

    def refuse(*a, **k):
        raise AssertionError("a process was started for a bad input")

    monkeypatch.setattr(launch, "spawn", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _fill(args: list[str], files: dict) -> list[str]:
    out = []
    for a in args:
        for name, path in files.items():
            a = a.replace("@" + name, path)
        out.append(a)
    return out


# (command line after +exp=smoke, environment, what the one line must say)
BAD = {
    # checked only after the ranks started
    "ckpt_flipped_bytes": (["checkpoint.resume=@flipped"], {}, "is corrupt"),
    "ckpt_shard_missing": (["checkpoint.resume=@missing"], {}, "is missing file"),
    "ckpt_latest_all_damaged": (["checkpoint.resume=latest", "checkpoint.dir=@all_bad"], {},
                                "no checkpoint in"),
    "tokens_past_256M_out_of_vocab": (["train.data=tokens", "train.data_path=@big.bin",
                                       "model.vocab_size=50257"], {}, "model.vocab_size"),
    "shm_without_room": ([], {"ZR_CPU_TRANSPORT": "shm", "@room": "8"}, "ZR_CPU_TRANSPORT"),
    "threads_bogus": ([], {"ZR_THREADS_PER_RANK": "bogus"}, "ZR_THREADS_PER_RANK"),
    "threads_zero": ([], {"ZR_THREADS_PER_RANK": "0"}, "ZR_THREADS_PER_RANK"),
    "zr_variable_typo": ([], {"ZR_CPU_TRANSPRT": "shm"}, "did you mean ZR_CPU_TRANSPORT"),
    "transport_bogus": ([], {"ZR_CPU_TRANSPORT": "fast"}, "ZR_CPU_TRANSPORT"),
    "heap_bogus": ([], {"ZR_HOST_HEAP": "jemalloc"}, "ZR_HOST_HEAP"),
    "ctimeout_microsecond": (["launcher.collective_timeout_s=1e-6"], {},
                             "launcher.collective_timeout_s"),
    "ctimeout_1e15": (["launcher.collective_timeout_s=1e15"], {},
                      "launcher.collective_timeout_s"),
    "timeout_min_1e300": (["launcher.timeout_min=1e300"], {}, "launcher.timeout_min"),
    # accepted silently, running something other than asked
    "plus_typo": (["+zero.stgae=3"], {}, "did you mean zero.stage"),
    "plus_new_section": (["+zeroo.stage=3"], {}, "zeroo"),
    "force_add_typo": (["++train.lrr=1"], {}, "did you mean train.lr"),
    "duplicate": (["zero.stage=1", "zero.stage=2"], {}, "zero.stage is given twice"),
    "duplicate_group": (["zero_r=c4", "zero_r=c5"], {}, "zero_r is given twice"),
    "bool_two": (["model.bias=2"], {}, "model.bias is a boolean"),
    "bool_one": (["train.progress=1"], {}, "train.progress is a boolean"),
    "bool_sweep": (["-m", "model.bias=0,1"], {}, "model.bias is a boolean"),
    "data_path_without_tokens": (["train.data_path=@ok.bin"], {}, "train.data=tokens"),
    "params_unknown": (["+experiment.params.tp=2"], {}, "experiment.params.tp"),
    "params_typo_fig5": (["+exp=fig5_convergence", "experiment.params.configz=[C1]"], {},
                         "did you mean experiment.params.configs"),
    "params_typo_fig5_plus": (["+exp=fig5_convergence", "+experiment.params.configz=[C1]"],
                              {}, "did you mean experiment.params.configs"),
    "zero_r_name_alone": (["zero_r.name=c4"], {}, "zero_r.name=c4"),
    "zero_r_preset_emptied": (["zero_r=c4", "zero_r.activation_checkpointing=false",
                               "zero_r.partition_activations=false",
                               "zero_r.constant_buffers=false",
                               "zero_r.contiguous_memory=false"], {}, "zero_r.name=custom"),
    # refused, but with words that did not help
    "unquoted_non_ascii": (["train.data=tokens", "train.data_path=/tmp/données.bin"], {},
                           "quote it"),
    "tilde": (["train.data=tokens", "train.data_path=~/tokens.bin"], {}, "$HOME"),
    "quoted_tilde": (["train.data=tokens", "train.data_path='~/tokens.bin'"], {},
                     "~ is not expanded"),
    "odd_sized_tokens": (["train.data=tokens", "train.data_path=@odd.bin"], {},
                         "train.data_path"),
}

# valid forms next to them: accepted
VALID = {
    "multirun_after_exp": (["-m", "zero.stage=0,1"], {}),
    "quoted_non_ascii": (["train.data=tokens", "'train.data_path=\"@données.bin\"'"], {}),
    "ckpt_auto_passes_damaged": (["checkpoint.resume=auto", "checkpoint.dir=@auto"], {}),
    "ctimeout_1s": (["launcher.collective_timeout_s=1"], {}),
    "ctimeout_century": (["launcher.collective_timeout_s=3.2e9"], {}),
    "timeout_min_year": (["launcher.timeout_min=525600"], {}),
    "bool_words": (["model.bias=false", "train.progress=true"], {}),
    "tokens": (["train.data=tokens", "train.data_path=@ok.bin"], {}),
    "threads_2": ([], {"ZR_THREADS_PER_RANK": "2"}),
    "other_zr_variable": ([], {"ZR_TEST_TAG": "x"}),
    "shm_with_room": ([], {"ZR_CPU_TRANSPORT": "shm", "@room": "4096"}),
    "zero_r_preset_other_stage": (["zero_r=c4", "zero.stage=3"], {}),
    "zero_r_custom": (["zero_r.name=custom", "zero_r.activation_checkpointing=true"], {}),
    "params_known_fig5": (["+exp=fig5_convergence", "experiment.params.configs=[C1]",
                           "experiment.params.mixed_configs=[]"], {}),

}


def _check(args: list[str], env: dict, files: dict, tmp_path, monkeypatch):
    """``cli.check_args`` on ``+exp=smoke`` (unless the case names its own) + ``args``."""
    for k, v in env.items():
        if k == "@room":
            monkeypatch.setattr(shm, "room", lambda mib=int(v): mib << 20)
        else:
            monkeypatch.setenv(k, v)
    args = _fill(args, files)
    exp = [] if any(a.startswith("+exp=") for a in args) else ["+exp=smoke"]
    # quoted values as the shell hands them over
    args = [a.strip("'") if a.startswith("'") else a for a in args]
    flags = [a for a in args if a.startswith("-")]
    return cli.check_args(flags + exp + [a for a in args if not a.startswith("-")]
                          + [f"experiment.results_dir={tmp_path / 'results'}",
                             f"hydra.run.dir={tmp_path / 'hydra'}"])


def test_params_read_beyond_the_overlay_and_presets_changed_by_an_experiment_are_valid():
    """fig2 reads C_B's bucket sizes from experiment.params without listing them in its
    overlay (``PARAMS``); fig7 with M_D off names its setups custom (no Table 3 preset
    claimed for what is not one): both plan."""
    from hydra import compose, initialize_config_dir

    from zero_repro import schema
    from zero_repro.lab import registry, sweep

    fig2 = registry.get("fig2_throughput")
    assert {"reduce_bucket", "allgather_bucket"} <= cli.experiment_params("fig2_throughput",
                                                                          fig2)
    schema.register_configs()
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        dcfg = compose("config", overrides=["+exp=fig7_cached_memory",
                                            "experiment.params.md_off=true"])
    cfg = launcher.check_config(schema.to_config(dcfg))
    names = {pp.cfg.zero_r.name for pp in sweep.plan(cfg, registry.get("fig7_cached_memory"))
             if not pp.point.params["m_d"]}
    assert names == {"custom"}


def test_auto_resume_passes_a_damaged_checkpoint_and_says_so(files, tmp_path, caplog,
                                                             monkeypatch):
    """The newest checkpoint is damaged: ``auto`` resumes from the older intact one, says so,
    and the ranks are handed that one (not left to pick the newest again)."""
    from zero_repro import config as C
    from zero_repro import schema

    cfg = C.Config()
    cfg.parallel.tp, cfg.train.steps = 1, 10
    cfg.checkpoint.resume, cfg.checkpoint.dir = "auto", files["auto"]
    with caplog.at_level(logging.WARNING):
        path = launcher.check_runnable(cfg, str(tmp_path))
    assert path.endswith("step_00000002")
    assert "step_00000004" in caplog.text and "is corrupt" in caplog.text
    handed = {}

    def ranks(fn, world, config_path, **kw):
        handed.update(schema.summary(schema.load(config_path))["checkpoint"])
        return [{"metrics": {}}]

    monkeypatch.setattr(launch, "spawn", ranks)
    launcher.run_training(cfg, str(tmp_path / "run"))
    assert handed["resume"] == path and handed["verify"] is False  # hashed here already


def test_battery(files, nothing_starts, tmp_path, monkeypatch, capsys):
    """Every bad input refused up front with one line that says what to change, none
    accepted (to fail late or run something else), no valid form refused; the counts are
    printed for the record."""
    counts = {"refused up front": 0, "accepted (late or silent)": 0, "valid refused": 0,
              "valid accepted": 0}
    wrong = []
    for i, (case, (args, env, says)) in enumerate(BAD.items()):
        with monkeypatch.context() as m:
            try:
                _check(args, env, files, tmp_path / f"b{i}", m)
                counts["accepted (late or silent)"] += 1
                wrong.append(f"{case}: accepted")
            except cli.UserError as e:
                counts["refused up front"] += 1
                if "\n" in str(e) or says not in str(e):
                    wrong.append(f"{case}: {e}")
        assert not (tmp_path / f"b{i}" / "results").exists(), f"{case}: something was written"
    for i, (case, (args, env)) in enumerate(VALID.items()):
        with monkeypatch.context() as m:
            try:
                _check(args, env, files, tmp_path / f"v{i}", m)
                counts["valid accepted"] += 1
            except cli.UserError as e:
                counts["valid refused"] += 1
                wrong.append(f"{case} (valid): {e}")
    with capsys.disabled():
        print(f"\ncareful user's battery: {counts}")
    assert wrong == []
    assert counts == {"refused up front": len(BAD), "accepted (late or silent)": 0,
                      "valid refused": 0, "valid accepted": len(VALID)}


def run_cli(*args, env=None, cwd=REPO):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, os.path.join(REPO, "run.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=180, env=e)


@pytest.mark.slow
def test_real_cli(tmp_path, files):
    """The same through ``python run.py``: one ``error:`` line and exit 2, or for the valid
    forms exit 0 (``experiment.action=plan``: nothing runs)."""
    results = tmp_path / "results"
    cases = [
        (["+exp=smoke", "+zero.stgae=3"], {}, 2, "did you mean zero.stage"),
        (["+exp=smoke", "train.data=tokens", "train.data_path=~/t.bin"], {}, 2, "$HOME"),
        (["+exp=smoke"], {"ZR_THREADS_PER_RANK": "bogus"}, 2, "ZR_THREADS_PER_RANK"),
        (["+exp=smoke"], {"ZERO_REPRO_CONF_DIR": str(tmp_path / "nowhere")}, 2,
         "ZERO_REPRO_CONF_DIR"),
        # valid: -m after +exp, a quoted non-ASCII path (two jobs planned, nothing run)
        (["+exp=smoke", "-m", "zero.stage=0,1", "train.data=tokens",
          f'train.data_path="{files["données.bin"]}"', "experiment.action=plan"], {}, 0,
         "experiment smoke: 1 points"),
    ]

    def one(i):
        args, env, _, _ = cases[i]
        return run_cli(*args, f"experiment.results_dir={results}",
                       f"hydra.run.dir={tmp_path / 'hydra' / str(i)}",
                       f"hydra.sweep.dir={tmp_path / 'multirun' / str(i)}", env=env)

    with cf.ThreadPoolExecutor(2) as pool:  # two CLI starts at a time (2 cores)
        runs = list(pool.map(one, range(len(cases))))
    for (args, _, code, says), p in zip(cases, runs):
        assert p.returncode == code, (args, p.returncode, p.stderr[-2000:])
        assert "Traceback" not in p.stdout + p.stderr, (args, p.stderr[-2000:])
        if code == 2:
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], \
                (args, p.stderr)
        else:
            assert p.stdout.count(says) == (2 if "-m" in args else 1), (args, p.stdout)
    assert not (results / "smoke" / "points.jsonl").exists()


# ------------------------------------------------------------------ what the logs and records say
def test_labels_are_built_from_the_components_that_ran():
    from zero_repro import config as C
    from zero_repro import schema
    from zero_repro.lab import records as R
    from zero_repro.scale.paper import table3

    cfg = schema.summary(C.Config())
    cfg["zero_r"]["name"] = "c4"  # the name alone: nothing of C4 ran
    assert "ZeRO-R" not in R.knob_label(cfg)
    cfg["zero_r"] = {**schema.summary(C.Config())["zero_r"], **vars(table3.zero_r_config("c4"))}
    assert "ZeRO-R C4" in R.knob_label(cfg)
    cfg["zero_r"]["partition_activations"] = False  # C4 less P_a: not C4
    assert R.knob_label(cfg).count("ZeRO-R CUSTOM") == 1


def test_step_and_done_lines_say_which_loss_and_only_fp16_has_a_scale():
    import torch

    from zero_repro import config as C
    from zero_repro.lab import rank_log as rank
    from zero_repro.runtime.zero.strategy import StepInfo

    info = StepInfo(skipped=False, grad_norm=1.0, loss_scale=1.0)
    args = (3, 10, 4.5, info, 0.1, 1024, 1.0, 0.0, "model states 1 MiB/rank",
            torch.device("cpu"))
    dp2 = rank.step_line(*args, dp=2, dtype="bf16")
    assert "rank-0 loss 4.5000" in dp2 and "scale" not in dp2
    assert "scale 1" in rank.step_line(*args, dp=2, dtype="fp16")
    assert "rank-0" not in rank.step_line(*args, dp=1, dtype="fp32")
    cfg = C.Config()
    m = {"losses": [5.0, 4.0], "loss_first": 5.0, "loss_last": 4.0, "step_time_s": 0.1,
         "tokens_per_s": 10.0, "tflops_per_gpu": 1.0, "skipped_steps": 0}
    assert "loss (mean of 2 DP ranks) 5.0000 -> 4.0000" in rank.summary_line(cfg, m, {})


def test_rank_0_says_when_it_waits_on_a_silent_rank(tmp_path, monkeypatch, caplog):
    """The watchdog on a fast clock: while rank 0 computes it says nothing; once it has
    waited in one collective for the report period it names the peer that is elsewhere and
    where, and again one period later."""
    import time

    from zero_repro.lab import rank

    monkeypatch.setattr(rank, "BEAT_S", 0.05)
    monkeypatch.setattr(rank, "WAIT_REPORT_S", 0.4)
    here = {"at": ("runtime/zero/stage0_ddp.py:10 backward", False)}
    monkeypatch.setattr(rank, "where_is", lambda thread: here["at"])
    dog = rank.Watchdog(str(tmp_path), 0, 2, 300.0)

    def peer(where: str, waiting: bool) -> None:
        with open(tmp_path / "progress" / "rank1", "w") as f:
            json.dump({"step": 1, "where": where, "waiting": waiting, "time": time.time()}, f)

    with caplog.at_level(logging.WARNING):
        dog.start()
        for _ in range(10):  # rank 0 computing, rank 1 stuck: nothing to say yet
            peer("lab/rank.py:190 inject_fault", False)
            time.sleep(0.1)
        assert "waited" not in caplog.text
        here["at"] = ("runtime/comm/comm.py:197 all_reduce", True)
        for _ in range(10):
            peer("lab/rank.py:190 inject_fault", False)
            time.sleep(0.1)
        dog.stop()
    lines = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(lines) >= 2, lines
    assert "runtime/comm/comm.py:197 all_reduce" in lines[0]
    assert "rank 1 is not in a collective (at lab/rank.py:190 inject_fault" in lines[0]
    assert "launcher.collective_timeout_s=300" in lines[0]


@pytest.mark.slow
def test_a_hung_rank_is_reported_every_30_s_until_the_timeout(tmp_path, capfd):
    """fault.mode=hang: rank 1 stops before its optimizer step; rank 0 says so at 30 s and
    60 s, and the run fails at launcher.collective_timeout_s."""
    from zero_repro import config as C

    cfg = C.Config()
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = 4, 1, False
    cfg.fault.rank, cfg.fault.step, cfg.fault.mode = 1, 1, "hang"
    cfg.launcher.collective_timeout_s = 75.0
    with pytest.raises(launch.WorkerFailed):
        launcher.run_training(cfg, str(tmp_path / "run"))
    err = capfd.readouterr().err
    said = [ln for ln in err.splitlines() if "rank 0 has waited" in ln]
    assert len(said) >= 2 and "rank 1 is not in a collective" in said[0], err
    assert "inject_fault" in said[0]  # where rank 1 is stuck
    assert "waited 30 s" in said[0] and "waited 60 s" in said[1], said


def test_bf16_run_that_stops_training_never_speaks_of_loss_scales(tmp_path, capfd):
    """A bf16 run whose gradients go non-finite: diverged, with its losses until then and
    no loss scale in its log lines (bf16 has none)."""
    from zero_repro import config as C
    from zero_repro.lab import records as R

    cfg = C.Config()
    cfg.model = C.ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=128,
                              vocab_pad_multiple=8)
    cfg.zero.dtype, cfg.train.lr, cfg.zero.grad_clip = "bf16", 1e4, 0.0
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = 30, 1, False
    cfg.train.micro_batch_size = 2
    with pytest.raises(launcher.RunDiverged) as e:
        launcher.run_training(cfg, str(tmp_path / "run"))
    assert R.classify_failure(e.value)[0] == "diverged"
    err = capfd.readouterr().err
    assert "scale" not in err, [ln for ln in err.splitlines() if "scale" in ln]
    assert "rank-0 loss" in err
