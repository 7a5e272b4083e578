"""run.threads: the cores a process may use, the adaptive controller's decisions, and the recipe field.

The controller is fed synthetic step times, so every decision here is deterministic: no test
depends on how fast this machine is or what else runs on it.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline import threads
from pipeline.cli import main
from pipeline.errors import RecipeError
from pipeline.recipe import load_recipe, recipe_from_dict
from pipeline.threads import (
    IDLE_SAMPLE_SECONDS,
    IdleProbe,
    StepPacer,
    ThreadController,
    ThreadPolicy,
    Tuning,
    available_cores,
    cgroup_cpu_limit,
    cpu_jiffies,
    parse_cfs,
    parse_cpu_max,
    physical_cores,
    rungs,
)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- core count
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_affinity_limits_the_cores_and_auto_starts_there() -> None:
    """A process pinned to one CPU starts auto at one thread, whatever os.cpu_count() says."""
    code = textwrap.dedent("""
        import os
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        import torch
        from pipeline import threads
        threads.install("auto")
        print(threads.affinity_cores(), threads.available_cores(), torch.get_num_threads())
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["1", "1", "1"]


def test_cpu_max_parsing() -> None:
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000") == 2.0  # period left out: the kernel's default
    assert parse_cpu_max("") is None and parse_cpu_max("lots 100000") is None
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("50000\n", "100000\n") == 0.5


def _fake_cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc = tmp_path / "proc_self_cgroup"
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc.write_text(membership)
    root = tmp_path / "sys_fs_cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_cgroup_v2_quota_is_the_tightest_on_the_way_to_the_root(tmp_path: Path) -> None:
    proc, root = _fake_cgroup(tmp_path, "0::/box/job\n", {
        "box/job/cpu.max": "max 100000\n",  # the job itself is unlimited ...
        "box/cpu.max": "150000 100000\n",  # ... but its parent holds it to one and a half CPUs
        "cpu.max": "400000 100000\n",
    })
    limit = cgroup_cpu_limit(proc, root)
    assert limit == 1.5
    assert available_cores(affinity=8, cpu_limit=limit, detect=False) == 2  # rounded up
    assert available_cores(affinity=1, cpu_limit=limit, detect=False) == 1  # affinity is tighter
    assert available_cores(affinity=8, cpu_limit=0.25, detect=False) == 1  # never below one


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    proc, root = _fake_cgroup(tmp_path, "5:memory:/x\n4:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_cpu_limit(proc, root) == 3.0
    unlimited, root2 = _fake_cgroup(tmp_path / "u", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(unlimited, root2) is None
    assert cgroup_cpu_limit(tmp_path / "missing", root2) is None  # not Linux: no limit known
    assert available_cores(affinity=4, cpu_limit=None, detect=False) == 4


def test_hyperthread_siblings_count_once(tmp_path: Path) -> None:
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(siblings + "\n")
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert physical_cores({0, 2}, tmp_path) == 1  # one core's two hyperthreads
    assert physical_cores({0, 1}, tmp_path) == 2
    assert physical_cores({5, 6}, tmp_path) == 2  # no topology known: each CPU its own core


def test_omp_num_threads_caps_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert available_cores(affinity=4) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: ignored, as torch ignores it
    assert available_cores(affinity=1) == 1


def test_rungs_cover_small_machines_and_thin_out_on_large() -> None:
    assert rungs(1) == [1] and rungs(2) == [1, 2] and rungs(8) == list(range(1, 9))
    big = rungs(64)
    assert big[0] == 1 and big[-2:] == [63, 64] and 32 in big and len(big) < 12


# ------------------------------------------------------------------------------ controller
Load = Callable[[int], dict[int, float]]


def feed(steps: int, load: Load, *, start: int = 2, top: int = 2, noise: float = 0.15,
         seed: int = 0) -> tuple[ThreadController, list[int]]:
    """Run a controller for ``steps`` steps; ``load(step)`` gives seconds per sample by thread count.
    Returns the controller and the thread count each step ran with."""
    applied: list[int] = []
    ctl = ThreadController(top=top, start=start, apply=applied.append)
    rng = random.Random(seed)
    ran = []
    for i in range(steps):
        ran.append(ctl.threads)
        ctl.observe(load(i)[ctl.threads] * (1 + rng.uniform(-noise, noise)))
    assert [t for _, t, _ in ctl.changes] == applied  # every switch went through apply, in order
    return ctl, ran


def constant(table: dict[int, float]) -> Load:
    return lambda step: table


QUIET = {1: 1.6, 2: 1.0}  # two threads are faster when the cores are ours
BUSY = {1: 1.9, 2: 3.0}  # a peer descheduled: every step waits for it at the barrier


def test_slowdown_lowers_threads_and_keeps_the_faster() -> None:
    onset = 400
    ctl, ran = feed(1600, lambda i: QUIET if i < onset else BUSY)
    assert ran[onset - 1] == 2  # quiet: all cores
    assert 1 in ran[onset:onset + 3 * ctl.tuning.window]  # reacts within a few windows
    busy = ran[onset + 3 * ctl.tuning.window:]
    assert busy.count(2) / len(busy) < 0.05  # only short probes at two threads
    assert ran[-1] == 1
    assert any("kept" not in why and t == 1 and "slower" in why for _, t, why in ctl.changes)


def test_load_present_from_the_first_step_is_found_by_looking_down_once() -> None:
    ctl, ran = feed(400, lambda i: BUSY)
    assert ctl.changes[0][1:] == (1, "try 1 (first look)")
    assert ran.count(2) / len(ran) < 0.1 and ran[-1] == 1


def test_fewer_threads_that_are_not_faster_are_not_kept() -> None:
    ctl, ran = feed(2000, lambda i: QUIET)
    # One look at a single thread at the start, then back, and nothing else: no oscillation.
    assert [t for _, t, _ in ctl.changes] == [1, 2]
    assert ran.count(1) <= ctl.tuning.window


@pytest.mark.parametrize("seed", range(10))
def test_noise_never_makes_it_oscillate(seed: int) -> None:
    # One count clearly faster: one look at the other at the start, then never again.
    ctl, _ = feed(3000, lambda i: QUIET, noise=0.25, seed=seed)
    assert [t for _, t, _ in ctl.changes] == [1, 2]
    # Counts within noise of each other: either may be kept (fewer threads at the same speed leave
    # a core to others), probes up back off, and the steps cost about what the faster count would.
    for table in ({1: 1.05, 2: 1.0}, {1: 1.0, 2: 1.04}):
        ctl, ran = feed(3000, constant(table), noise=0.25, seed=seed)
        tune = ctl.tuning
        backoffs = math.log2(tune.probe_max / tune.probe_every) + 1
        probes = backoffs + 3000 / (tune.probe_max * tune.window) + 1
        # A look down at the start, then the probes up, each there and back.
        assert len(ctl.changes) <= 2 + 2 * probes, (table, ctl.changes)
        cost = sum(table[t] for t in ran) / len(ran)
        assert cost <= min(table.values()) * 1.05, (table, cost)


def test_probes_back_up_when_the_machine_goes_quiet() -> None:
    quiet_at = 1000
    ctl, ran = feed(3000, lambda i: BUSY if i < quiet_at else QUIET)
    assert ran[quiet_at - 1] == 1
    back = ran.index(2, quiet_at)
    wait = ctl.tuning.probe_max * ctl.tuning.window
    assert back - quiet_at <= wait  # found within the longest wait between probes
    assert set(ran[back + ctl.tuning.window:]) == {2}  # and stays


def test_probes_up_back_off_while_the_load_lasts() -> None:
    ctl, ran = feed(4000, lambda i: BUSY)
    probes = [step for step, t, why in ctl.changes if "probe" in why]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps)  # the wait only grows while probes keep losing ...
    assert max(gaps) <= ctl.tuning.probe_max * ctl.tuning.window + ctl.tuning.window  # ... up to a cap
    assert len(probes) < 4000 / (ctl.tuning.probe_max * ctl.tuning.window) + 8


def test_a_losing_probe_is_cut_short() -> None:
    ctl, ran = feed(200, lambda i: BUSY, noise=0.0, start=1)
    first = ctl.changes[0]
    assert first[1] == 2 and "probe" in first[2]
    assert ctl.changes[1][0] - first[0] == ctl.tuning.cut_short  # not a whole window at the slow count


def test_more_cores_walk_down_to_the_fastest_count() -> None:
    # Four cores, two taken by others: four threads crawl, two are best, one is slower again.
    table = {1: 1.5, 2: 0.9, 3: 1.3, 4: 2.5}
    ctl, ran = feed(800, lambda i: table, start=4, top=4)
    assert ran[-1] == 2 and ran[200:].count(2) / len(ran[200:]) > 0.9


def test_bad_times_are_ignored() -> None:
    ctl = ThreadController(top=2, start=2, apply=lambda t: None)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        ctl.observe(bad)
    assert ctl.steps == 0 and ctl.changes == []


def test_pacer_times_steps_per_sample_from_the_clock() -> None:
    now = [0.0]
    seen: list[float] = []

    class Spy(ThreadController):
        def observe(self, seconds_per_sample: float) -> None:
            seen.append(seconds_per_sample)

    pacer = StepPacer(Spy(top=2, start=2, apply=lambda t: None), clock=lambda: now[0])
    pacer.start()
    for dt, n in ((3.2, 32), (1.6, 32), (0.8, 4)):
        now[0] += dt
        pacer.step(n)
    now[0] += 100.0  # evaluation between epochs is not a step
    pacer.start()
    now[0] += 0.32
    pacer.step(32)
    assert seen == pytest.approx([0.1, 0.05, 0.2, 0.01])


def test_a_fixed_setting_has_an_inert_pacer() -> None:
    assert ThreadPolicy(2, 2).pacer().controller is None
    assert ThreadPolicy("auto", 2).pacer().controller is not None


# ------------------------------------------------------------------------------ idle cores
def write_stat(path: Path, per_cpu: dict[int, tuple[int, int]]) -> None:
    """A /proc/stat with each CPU's (busy, idle) ticks, busy split over user and system."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu, (busy, idle) in per_cpu.items():
        lines.append(f"cpu{cpu} {busy - busy // 3} 0 {busy // 3} {idle} 0 0 0 0 0 0")
    lines += ["intr 12345", "ctxt 678"]
    path.write_text("\n".join(lines) + "\n")


def test_jiffies_sum_busy_and_total_over_the_cpus_asked(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    write_stat(stat, {0: (300, 700), 1: (50, 950), 2: (1000, 0)})
    assert cpu_jiffies(None, stat) == (1350, 3000)
    assert cpu_jiffies({0, 2}, stat) == (1300, 2000)  # the affinity mask's CPUs only
    assert cpu_jiffies({7}, stat) is None and cpu_jiffies(None, tmp_path / "absent") is None


class FakeMachine:
    """/proc/stat, a wall clock and this process's CPU clock that advance together: ``busy`` cores'
    worth of other processes' work and ``own`` of this process's per second of wall time."""

    def __init__(self, path: Path, cpus: int, busy: float, own: float = 0.0) -> None:
        self.path, self.cpus, self.busy, self.own = path, cpus, busy, own
        self.now = 0.0
        self.sleeps: list[float] = []
        self.write()

    def write(self) -> None:
        ticks = 100 * self.now
        per = (self.busy + self.own) / self.cpus  # every CPU equally loaded
        write_stat(self.path, {c: (round(per * ticks), round((1 - per) * ticks)) for c in range(self.cpus)})

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.write()

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(seconds)

    def probe(self) -> IdleProbe:
        probe = IdleProbe(None, self.path, clock=lambda: self.now, cpu_clock=lambda: self.own * self.now,
                          ticks_per_second=100.0)
        probe.start()
        return probe


@pytest.mark.parametrize("busy,own,idle", [(0.0, 0.0, 4), (1.0, 0.0, 3), (2.2, 0.0, 2), (3.6, 0.0, 1),
                                           (8.0, 0.0, 1), (0.0, 1.0, 4), (1.0, 1.0, 3)])
def test_the_probe_counts_the_cores_other_processes_leave_idle(tmp_path: Path, busy: float, own: float,
                                                                idle: int) -> None:
    machine = FakeMachine(tmp_path / "stat", 4, busy, own)
    probe = machine.probe()
    machine.advance(2.0)  # planning took 2 s: nothing to wait for
    assert probe.idle_cores(4, machine.sleep) == idle  # this process's own work is not another's load
    assert machine.sleeps == []


def test_a_short_look_waits_out_the_sample_and_an_unreadable_one_keeps_every_core(tmp_path: Path) -> None:
    machine = FakeMachine(tmp_path / "stat", 2, 1.0)
    probe = machine.probe()
    machine.advance(0.03)
    assert probe.idle_cores(2, machine.sleep) == 1
    assert machine.sleeps == [pytest.approx(IDLE_SAMPLE_SECONDS - 0.03)]
    blind = IdleProbe(None, tmp_path / "absent")
    blind.start()
    assert blind.idle_cores(2, machine.sleep) == 2


def test_auto_starts_from_the_idle_cores_once_and_loops_carry_on_from_the_last(
        tmp_path: Path, torch_threads: list[int]) -> None:
    machine = FakeMachine(tmp_path / "stat", 4, 2.0)
    said: list[str] = []
    policy = ThreadPolicy("auto", 4, log=said.append, probe=machine.probe())
    machine.advance(1.0)
    assert policy.initial() == 4  # not looked yet
    assert policy.settle() == 2 and torch_threads == [2]
    assert "auto starts at 2 of 4 cores (other processes used 2.0 of them)" in said[0]
    machine.busy = 0.0
    machine.advance(1.0)
    assert policy.settle() == 2 and policy.initial() == 2 and torch_threads == [2]  # looked once
    assert policy.current() == 2
    controller = policy.pacer().controller
    assert controller is not None and controller.threads == 2 and controller.ladder[-1] == 4  # may grow
    controller._switch(3, "forced")
    assert policy.current() == 3  # evaluation after training starts where training ended
    fixed = ThreadPolicy(2, 2, probe=machine.probe())
    assert fixed.settle() == 2 and fixed.current() == 2


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not Path("/proc/stat").exists(), reason="needs two CPUs and /proc/stat (Linux)")
def test_on_this_machine_two_spinning_processes_take_cores_away(torch_threads: list[int]) -> None:
    spin = "import time\nend = time.time() + 5\nwhile time.time() < end: pass\n"
    cpus = sorted(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(min(len(cpus), 2))]
    try:
        import time

        time.sleep(0.5)  # both spinning
        policy = threads.install("auto", measure_idle=True)
        time.sleep(0.4)
        start = threads.settle()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert start is not None and start <= max(1, policy.cores - 1)
    assert threads.compute_threads() == start


# ----------------------------------------------------------------------- through the trainer
@pytest.fixture
def torch_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Record the policy's torch.set_num_threads calls; restore the count and the policy afterwards."""
    import torch

    before = torch.get_num_threads()
    calls: list[int] = []

    def spy(n: int) -> None:
        calls.append(n)
        torch.set_num_threads(n)

    threads.torch.get_num_threads()  # the lazy stand-in copies torch's namespace now, not over the spy later
    monkeypatch.setattr(threads.torch, "set_num_threads", spy)
    try:
        yield calls
    finally:
        threads.uninstall()
        torch.set_num_threads(before)


def _train_under(load: dict[int, float], setting: threads.ThreadSetting, steps: int = 96) -> int:
    """Train a tiny model with the installed policy (run.deterministic: false, where the controller
    adapts torch's intra-op threads); each batch advances a fake clock by the time ``load`` gives for
    the thread count torch has now. Returns torch's thread count at the end."""
    import torch

    from pipeline.methods.trainer import TrainConfig, train

    now = [0.0]
    policy = threads.install(setting, deterministic=False)
    policy.clock = lambda: now[0]

    def batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(epoch)
        for _ in range(steps // 4):
            now[0] += 8 * load[torch.get_num_threads()]
            yield torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)

    model = torch.nn.Linear(4, 2)
    train(model, model.parameters(), batches, None, TrainConfig(epochs=4, lr=0.01), checkpoint_dir=None)
    return torch.get_num_threads()


def test_auto_adapts_inside_the_trainer(torch_threads: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    assert _train_under(BUSY, "auto") == 1
    assert torch_threads[0] == 2 and 1 in torch_threads  # started from the cores, then went down


def test_a_fixed_count_never_changes(torch_threads: list[int]) -> None:
    assert _train_under(BUSY, 2) == 2
    assert torch_threads == [2]  # set once by install, never by the training loop
    assert _train_under(QUIET, 1) == 1
    assert torch_threads == [2, 1]


def test_a_loop_after_one_that_kept_fewer_threads_waits_before_probing(torch_threads: list[int]) -> None:
    import torch

    torch.set_num_threads(2)
    policy = ThreadPolicy("auto", 2)
    first = policy.pacer().controller
    assert first is not None and first.probe_wait is None
    for _ in range(400):
        first.observe(BUSY[first.threads])
    assert first.threads == 1
    second = policy.pacer().controller
    assert second is not None and second.threads == 1
    assert second.probe_wait == first.up_wait > first.tuning.probe_every
    for _ in range(second.tuning.window * (second.probe_wait - 1)):
        second.observe(BUSY[second.threads])
    assert second.changes == []  # no probe up before the wait the last loop had reached
    for _ in range(second.tuning.window):
        second.observe(BUSY[second.threads])
    assert "probe" in second.changes[0][2]


def test_no_policy_installed_leaves_threads_alone(torch_threads: list[int]) -> None:
    import torch

    from pipeline.methods.trainer import TrainConfig, train

    threads.uninstall()
    model = torch.nn.Linear(4, 2)
    batches = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 20
    train(model, model.parameters(), lambda e: batches, None, TrainConfig(epochs=2), checkpoint_dir=None)
    assert torch_threads == []


# --------------------------------------------------------------------------------- recipe
def _recipe(threads_value: object) -> dict[str, object]:
    return {"name": "t", "run": {"threads": threads_value}, "stages": {"d": {"type": "digits"}}}


def test_auto_is_the_default_and_ints_pass() -> None:
    assert recipe_from_dict({"name": "t", "stages": {"d": {"type": "digits"}}}).run.threads == "auto"
    assert recipe_from_dict(_recipe("auto")).run.threads == "auto"
    assert recipe_from_dict(_recipe(3)).run.threads == 3


@pytest.mark.parametrize("bad", [0, -1, "many", True, 2.5, None])
def test_bad_threads_name_the_field_and_the_valid_values(bad: object) -> None:
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(_recipe(bad))
    msg = str(err.value)
    assert "run.threads" in msg and "auto or an int >= 1" in msg and repr(bad) in msg


@pytest.mark.parametrize("bad", ["0", "-1", "many"])
def test_bad_threads_exit_2_naming_file_and_line(tmp_path: Path, bad: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "r.yaml"
    p.write_text(f"name: t\nrun:\n  threads: {bad}\nstages:\n  d: {{type: digits}}\n")
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}:3" in err and "run.threads" in err and "auto or an int >= 1" in err


def test_every_example_recipe_uses_auto() -> None:
    recipes = sorted((ROOT / "recipes").rglob("*.yaml"))
    assert recipes
    for path in recipes:
        assert load_recipe(path).run.threads == "auto", path


def test_tuning_defaults_keep_more_threads_harder_to_win() -> None:
    t = Tuning()
    assert t.keep_more < t.keep_fewer <= 1.0 < t.cut_ratio < t.slower < t.at_once
