"""How many threads torch computes on, and how that number follows the load on the machine.

``run.threads: auto`` (the default) starts from the cores this process may use (its CPU affinity and
its cgroup's CPU quota, whichever is smaller) less those other processes keep busy when the run's
computation begins (:class:`IdleProbe`), and adapts while training. Why adapt: torch's intra-op
pool is OpenMP, whose threads meet at a barrier at the end of every parallel region. When another
process takes one of the cores, one of our threads is descheduled and every step waits for it, so N
threads on N shared cores can be several times slower than fewer threads. No count is right in
advance (a quiet device wants all its cores, a busy one fewer, and the load changes during a run),
so :class:`ThreadController` measures: it tries fewer threads when steps slow down, keeps whichever
count is faster, and now and then probes back up in case the machine went quiet.

A fixed ``run.threads: N`` sets N once and never changes it.

Under ``run.deterministic: true`` (the default) training and evaluation on a CPU compute in fixed
micro-batches, each on one thread (:mod:`pipeline.methods.microbatch`): the count chosen here is then
how many micro-batches run at once (what the controller adapts), while torch's intra-op pool stays at
one thread, so no thread count ever changes a result. ``false`` restores intra-op threads that the
controller adapts, whose reduction order (and so the last bits of the weights) follows the load.

``torch.set_num_threads`` is process-wide, so the policy is applied in one place (the CLI's ``run``
installs it with :func:`install`) and changed only from the training loop's own thread, through the
:class:`StepPacer` that :func:`step_pacer` hands each training loop.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

ThreadSetting = int | Literal["auto"]

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_STAT = Path("/proc/stat")
CGROUP_ROOT = Path("/sys/fs/cgroup")


# ------------------------------------------------------------------------------------- cores
CPU_SYSFS = Path("/sys/devices/system/cpu")


def affinity_cores(sysfs: Path = CPU_SYSFS) -> int | None:
    """Physical cores this process may run on: the CPUs of its affinity mask, hyperthread siblings
    counted once (two threads on one core's siblings share its arithmetic units, so compute-bound
    torch gains nothing from the second, which is also why torch's own default counts physical
    cores). None where the OS has no affinity call (macOS)."""
    cpus = affinity_cpus()
    return None if cpus is None else physical_cores(cpus, sysfs)


def affinity_cpus() -> set[int] | None:
    """The CPUs of this process's affinity mask (None where the OS has no affinity call)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def physical_cores(cpus: set[int], sysfs: Path = CPU_SYSFS) -> int:
    """How many distinct cores ``cpus`` lie on, from sysfs's sibling lists (each CPU its own core when
    sysfs does not say)."""
    cores = set()
    for cpu in cpus:
        text = _read(sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        cores.add(text.strip() if text and text.strip() else f"cpu{cpu}")
    return len(cores)


def parse_cpu_max(text: str) -> float | None:
    """CPUs granted by a cgroup v2 ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD" for no limit)."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = float(parts[0])
        period = float(parts[1]) if len(parts) > 1 else 100_000.0
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """CPUs granted by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (a quota of -1: no limit)."""
    try:
        quota, period = float(quota_text.strip()), float(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs; None if unlimited.

    A container's quota (docker ``--cpus``, a Kubernetes CPU limit) leaves the affinity mask
    untouched: every core stays visible while the process is throttled to fewer of them, and
    threads beyond the quota wait for the next period at every barrier. A parent's limit binds a
    child too, so the walk goes up to the root.
    """
    text = _read(proc_cgroup)
    if text is None:
        return None
    limits: list[float] = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, where = rest.partition(":")
        if not hierarchy or not where.startswith("/"):
            continue
        relative = Path(where.lstrip("/"))
        chain = [relative, *relative.parents]
        if controllers == "":  # cgroup v2: one unified hierarchy
            found = (parse_cpu_max(t) for d in chain if (t := _read(root / d / "cpu.max")) is not None)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            mounts = [root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()]
            found = (
                parse_cfs(q, p) for mount in mounts[:1] for d in chain
                if (q := _read(mount / d / "cpu.cfs_quota_us")) is not None
                and (p := _read(mount / d / "cpu.cfs_period_us")) is not None
            )
        else:
            continue
        limits.extend(x for x in found if x is not None)
    return min(limits) if limits else None


def available_cores(affinity: int | None = None, cpu_limit: float | None = None, *,
                    detect: bool = True) -> int:
    """Threads worth starting with: the affinity mask's physical cores, capped by the cgroup quota
    (rounded up) and by ``OMP_NUM_THREADS`` where set.

    Rounded up because a fractional quota still lets that many threads run part of each period;
    where the extra thread costs more than it gives, the controller finds that out and drops it.
    ``detect=False`` uses only the values given (tests).
    """
    if detect:
        affinity = affinity if affinity is not None else affinity_cores()
        cpu_limit = cpu_limit if cpu_limit is not None else cgroup_cpu_limit()
    cores = affinity or os.cpu_count() or 1
    if cpu_limit is not None:
        cores = min(cores, max(1, math.ceil(cpu_limit - 1e-9)))
    if detect and (env := os.environ.get("OMP_NUM_THREADS", "").strip()).isdigit() and int(env) >= 1:
        cores = min(cores, int(env))  # the user's own cap, as torch's default honours it
    return max(1, cores)


# ------------------------------------------------------------------------------ idle cores
IDLE_SAMPLE_SECONDS = 0.1  # the shortest look at the machine: 10 scheduler ticks per CPU at 100 Hz


def cpu_jiffies(cpus: set[int] | None, stat: Path = PROC_STAT) -> tuple[int, int] | None:
    """(busy, total) scheduler ticks since boot, summed over ``cpus`` (all CPUs when None), from
    ``/proc/stat``; None where it cannot be read (not Linux). Idle and I/O wait count as not busy."""
    text = _read(stat)
    if text is None:
        return None
    busy = total = 0
    seen = False
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is already inside user)
        ticks = [int(f) for f in fields[:8]]
        busy += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
        total += sum(ticks)
        seen = True
    return (busy, total) if seen else None


@dataclass
class IdleProbe:
    """How many of this process's cores other processes leave idle, seen between :meth:`start` and
    :meth:`idle_cores`: the CPUs' busy time less this process's own CPU time, over the wall time.

    Why measure: ``auto`` starting from every usable core loses most at the start of a run on a
    busy machine (the cache build runs before any training loop has timed a step), where a core
    another process keeps busy makes every OpenMP barrier wait. The look is taken from ``install``
    until the first computation, so it costs nothing when planning took longer than
    ``IDLE_SAMPLE_SECONDS``.
    """

    cpus: set[int] | None = None
    stat: Path = PROC_STAT
    clock: Callable[[], float] = time.monotonic
    cpu_clock: Callable[[], float] = time.process_time  # every thread of this process
    ticks_per_second: float = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    others: float | None = None  # what the last look found: cores' worth of other processes' work
    _start: tuple[float, float, tuple[int, int]] | None = field(default=None, repr=False)

    def start(self) -> None:
        jiffies = cpu_jiffies(self.cpus, self.stat)
        self._start = None if jiffies is None else (self.clock(), self.cpu_clock(), jiffies)

    def others_busy(self, sleep: Callable[[float], None] = time.sleep) -> float | None:
        """Cores' worth of CPU time other processes used since :meth:`start` (None: nothing to read)."""
        if self._start is None:
            return None
        wall0, own0, (busy0, _total0) = self._start
        wait = IDLE_SAMPLE_SECONDS - (self.clock() - wall0)
        if wait > 0:
            sleep(wait)
        jiffies = cpu_jiffies(self.cpus, self.stat)
        wall = self.clock() - wall0
        if jiffies is None or wall <= 0:
            return None
        busy = (jiffies[0] - busy0) / self.ticks_per_second
        own = self.cpu_clock() - own0
        return max(0.0, busy - own) / wall

    def idle_cores(self, cores: int, sleep: Callable[[float], None] = time.sleep) -> int:
        """``cores`` less the cores other processes keep busy (rounded to the nearest; at least 1)."""
        self.others = self.others_busy(sleep)
        if self.others is None:
            return cores
        return max(1, min(cores, cores - math.floor(self.others + 0.5)))


# -------------------------------------------------------------------------------- controller
def rungs(top: int) -> list[int]:
    """Thread counts the controller moves between, ascending: every count on a small machine; on a
    large one, the neighbours of ``top`` (one busy core costs one thread) and halvings below."""
    if top <= 8:
        return list(range(1, top + 1))
    counts = {top, top - 1, (3 * top) // 4}
    n = top
    while n > 1:
        n //= 2
        counts.add(max(1, n))
    return sorted(counts)


@dataclass(frozen=True)
class Tuning:
    """The controller's knobs. Step times are noisy, so decisions use window medians, a slowdown
    must persist, and more threads must win by a clearer margin than fewer (hysteresis)."""

    window: int = 8  # steps per measurement: a decision is made on their median
    baseline: int = 5  # windows whose median is the usual time at a count
    slower: float = 1.3  # a window this much slower than the usual at its count is a slowdown ...
    confirm: int = 2  # ... once it lasts this many windows in a row
    at_once: float = 2.0  # ... or at once, when a window is this much slower
    keep_fewer: float = 0.97  # fewer threads are kept when their steps take at most this times as long
    keep_more: float = 0.90  # more threads only when this much faster: an extra thread costs neighbours
    cut_short: int = 3  # after this many steps, a trial this much slower than the count it left ...
    cut_ratio: float = 1.25  # ... ends at once: a losing probe costs few steps
    probe_every: int = 4  # windows before probing up again after a probe lost; doubled at each loss
    probe_max: int = 64  # the longest wait between probes up


@dataclass
class _Trial:
    came_from: int
    reference: float  # seconds per sample at came_from, the time to beat


@dataclass
class ThreadController:
    """Picks the intra-op thread count from the per-sample step times of one training loop.

    Fed one time per step (:meth:`observe`). At the end of every window of steps it compares the
    window's median with what it has seen, and may start a *trial*: switch to a neighbouring count
    for one window and keep it if its median beats the count it left. Trials go down after the first
    window (the load may have been there before any step was timed) and whenever steps slow down
    markedly; they go up every ``probe_every`` windows, waiting twice as long after each lost probe,
    and at once when steps at the current count speed up markedly (the machine went quiet). A won
    trial goes on in the same direction. Times from different models are not comparable, so each
    training loop gets its own controller (:func:`step_pacer`).
    """

    top: int
    start: int
    apply: Callable[[int], None]
    tuning: Tuning = field(default_factory=Tuning)
    report: Callable[[str], None] | None = None  # told of each count kept (not of lost probes)
    probe_wait: int | None = None  # windows before the first probe up (default: after the first window)
    changes: list[tuple[int, int, str]] = field(default_factory=list)  # every switch: (step, threads, why)

    def __post_init__(self) -> None:
        self.ladder = rungs(max(1, self.top))
        self.threads = min(self.ladder, key=lambda r: (abs(r - self.start), -r))
        if self.threads != self.start:
            self.apply(self.threads)
        self.steps = 0
        self._open: list[float] = []
        self._windows = 0
        self._recent: dict[int, deque[float]] = {}
        self._slow_run = 0
        self._explored_down = False
        # A loop that knows nothing of the counts above probes after one window; one that follows a
        # loop which kept fewer threads waits as long as that loop would have (the load is likely
        # still there: probing at once would pay again for what the last loop learnt).
        self._up_wait = self.probe_wait or self.tuning.probe_every
        self._next_up = self.probe_wait or 1
        self._trial: _Trial | None = None

    @property
    def up_wait(self) -> int:
        """Windows this controller now waits between probes up (grows while probes lose)."""
        return self._up_wait

    # -- feeding
    def observe(self, seconds_per_sample: float) -> None:
        """One step's time per sample; may change the thread count (through ``apply``)."""
        if not math.isfinite(seconds_per_sample) or seconds_per_sample <= 0:
            return
        self.steps += 1
        self._open.append(seconds_per_sample)
        tune = self.tuning
        trial = self._trial
        if trial is not None and tune.cut_short <= len(self._open) < tune.window:
            so_far = statistics.median(self._open)
            if so_far > trial.reference * tune.cut_ratio:
                self._open.clear()
                self._end_trial(trial, so_far)
                return
        if len(self._open) < tune.window:
            return
        median = statistics.median(self._open)
        self._open.clear()
        self._windows += 1
        if trial is not None:
            self._end_trial(trial, median)
        else:
            self._settled(median)

    # -- decisions
    def _neighbour(self, step: int) -> int | None:
        i = self.ladder.index(self.threads) + step
        return self.ladder[i] if 0 <= i < len(self.ladder) else None

    def _switch(self, threads: int, why: str) -> None:
        self.threads = threads
        self.apply(threads)
        self.changes.append((self.steps, threads, why))

    def _record(self, threads: int, median: float) -> None:
        self._recent.setdefault(threads, deque(maxlen=self.tuning.baseline)).append(median)

    def _settled(self, median: float) -> None:
        tune, t = self.tuning, self.threads
        recent = self._recent.get(t)
        # The time to compare with: the median of the last few windows at this count, robust to one
        # odd window, and following a lasting change of load once fewer threads have not helped.
        usual = statistics.median(recent) if recent else None
        self._record(t, median)
        slow = usual is not None and median > usual * tune.slower
        self._slow_run = self._slow_run + 1 if slow else 0
        if usual is not None and median * tune.slower < usual:
            # Markedly faster than just before at this count: the load that made fewer threads
            # win may be gone, so the wait for the next probe up starts over.
            self._up_wait, self._next_up = tune.probe_every, self._windows
        lower, upper = self._neighbour(-1), self._neighbour(+1)
        if lower is not None:
            sudden = usual is not None and median > usual * tune.at_once
            if not self._explored_down or self._slow_run >= tune.confirm or sudden:
                ratio = median / (usual or median)
                why = f"steps {ratio:.1f}x slower" if self._explored_down else "first look"
                self._explored_down = True
                self._start_trial(lower, median, why)
                return
        if upper is not None and self._windows >= self._next_up:
            self._start_trial(upper, median, "probe")

    def _start_trial(self, threads: int, reference: float, why: str) -> None:
        self._slow_run = 0
        self._trial = _Trial(came_from=self.threads, reference=reference)
        self._switch(threads, f"try {threads} ({why})")

    def _end_trial(self, trial: _Trial, median: float) -> None:
        tune, t = self.tuning, self.threads
        self._trial = None
        self._record(t, median)
        down = t < trial.came_from
        if median <= trial.reference * (tune.keep_fewer if down else tune.keep_more):
            if self.report is not None:
                self.report(f"threads: {trial.came_from} -> {t}: steps took {median / trial.reference:.2f}x "
                            f"the time per sample (after {self.steps} steps)")
            self._up_wait = tune.probe_every
            self._next_up = self._windows + (tune.probe_every if down else 1)
            # The count moved to is compared from now on with what was just measured there: older
            # times at it were taken under another load.
            self._recent[t] = deque([median], maxlen=tune.baseline)
            onward = self._neighbour(-1 if down else +1)
            if onward is not None:
                self._start_trial(onward, median, "the last one was faster")
            return
        self._switch(trial.came_from, f"back to {trial.came_from}: {t} was "
                     f"{median / trial.reference:.2f}x the time per sample")
        if down:
            # Fewer threads did not help, so this level is the new normal at came_from: only a
            # further slowdown from here tries fewer again.
            self._recent[trial.came_from] = deque([trial.reference], maxlen=tune.baseline)
        else:
            self._up_wait = min(self._up_wait * 2, tune.probe_max)
            self._next_up = self._windows + self._up_wait


# ------------------------------------------------------------------------------- the policy
class StepPacer:
    """What a training loop calls: :meth:`start` as an epoch's batches begin, :meth:`step` after each
    optimizer step. Times from one step's end to the next (the batch's wait included: fewer threads
    can also speed up the work that produces batches), per sample. A fixed setting's pacer does
    nothing, so the loop has no branch."""

    def __init__(self, controller: ThreadController | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.controller = controller
        self._clock = clock
        self._last: float | None = None

    def start(self) -> None:
        if self.controller is not None:
            self._last = self._clock()

    def step(self, samples: int) -> None:
        if self.controller is None:
            return
        now = self._clock()
        if self._last is not None and samples > 0:
            self.controller.observe((now - self._last) / samples)
        self._last = now


@dataclass
class ThreadPolicy:
    """``run.threads`` as applied to this process: a fixed count, or ``auto`` from ``cores`` (less those
    ``probe`` finds other processes keeping busy, looked at once, when the first computation starts)."""

    setting: ThreadSetting
    cores: int
    log: Callable[[str], None] | None = None
    deterministic: bool = True
    tuning: Tuning = field(default_factory=Tuning)
    clock: Callable[[], float] = time.perf_counter
    probe: IdleProbe | None = None
    _last: ThreadController | None = field(default=None, repr=False)  # the latest loop's controller
    _start: int | None = field(default=None, repr=False)  # auto's start, once settled
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def adaptive(self) -> bool:
        return self.setting == "auto"

    def initial(self) -> int:
        """The count computation starts from: a fixed setting; auto's cores, less the busy ones once
        :meth:`settle` has looked."""
        if self.setting != "auto":
            return int(self.setting)
        return self._start if self._start is not None else self.cores

    def settle(self) -> int:
        """Under auto, look once at how busy the machine is (``probe``) and start from the idle cores:
        torch's intra-op count is set to them. Later calls return the same count."""
        if self.setting != "auto":
            return int(self.setting)
        with self._lock:
            if self._start is None:
                start = self.probe.idle_cores(self.cores) if self.probe is not None else self.cores
                self._start = start
                if start != self.cores:
                    torch.set_num_threads(start)
                    if self.log is not None:
                        used = self.probe.others if self.probe is not None else None
                        self.log(f"threads: auto starts at {start} of {self.cores} cores (other processes "
                                 f"used {used or 0:.1f} of them); training probes up when they go quiet")
            return self._start

    def current(self) -> int:
        """The count a new loop starts from: what the latest training loop settled on, else the start."""
        last = self._last
        return last.threads if last is not None else self.settle()

    def pacer(self, apply: Callable[[int], None] | None = None, start: int | None = None,
              top: int | None = None) -> StepPacer:
        """A pacer for one loop; by default it adapts torch's intra-op threads, or what ``apply`` sets
        (the number of micro-batch threads), from ``start`` up to ``top``."""
        if not self.adaptive:
            return StepPacer(None)
        self.settle()
        last = self._last
        wait = last.up_wait if last is not None and last.threads < last.ladder[-1] else None
        controller = ThreadController(top=min(self.cores, top or self.cores),
                                      start=start if start is not None else torch.get_num_threads(),
                                      apply=apply or torch.set_num_threads, tuning=self.tuning,
                                      report=self.log, probe_wait=wait)
        self._last = controller
        return StepPacer(controller, self.clock)


_installed: ThreadPolicy | None = None


def install(setting: ThreadSetting, log: Callable[[str], None] | None = None, *,
            deterministic: bool = True, measure_idle: bool = False) -> ThreadPolicy:
    """Apply ``run.threads`` and ``run.deterministic`` to this process (the one place that does): set
    torch's thread count, and make :func:`step_pacer` adapt it when ``setting`` is ``auto``.
    ``measure_idle`` (a run does; tests that count threads do not): auto's start leaves out the cores
    other processes keep busy, looked at from now until :func:`settle`."""
    global _installed
    probe = None
    if setting == "auto" and measure_idle:
        probe = IdleProbe(affinity_cpus())
        probe.start()
    policy = ThreadPolicy(setting, available_cores() if setting == "auto" else int(setting), log,
                          deterministic, probe=probe)
    torch.set_num_threads(policy.initial())
    if deterministic:  # cuDNN's autotuner and its atomics-based kernels vary run to run
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    _installed = policy
    return policy


def settle() -> int | None:
    """Auto's start, measured now if it was not yet (call it as the computation begins); None when no
    policy is installed."""
    return _installed.settle() if _installed is not None else None


def uninstall() -> None:
    """Forget the installed policy: training loops then leave the thread count alone."""
    global _installed
    _installed = None


def step_pacer(apply: Callable[[int], None] | None = None, start: int | None = None,
               top: int | None = None) -> StepPacer:
    """A pacer for one training loop: adapting under ``run.threads: auto``, inert otherwise (a fixed
    count, or no policy installed, as when the trainer is called from a script or a test).
    ``apply``/``start``/``top``: what it adapts instead of torch's intra-op threads (see
    :meth:`ThreadPolicy.pacer`)."""
    return _installed.pacer(apply, start, top) if _installed is not None else StepPacer(None)


def deterministic() -> bool:
    """Whether CPU training and evaluation compute thread-invariantly (``run.deterministic``; true
    when no policy is installed: scripts and tests get the contract too)."""
    return _installed.deterministic if _installed is not None else True


def compute_threads() -> int:
    """Threads a deterministic loop (training, evaluation) starts with: under auto, what the latest
    training loop settled on, else the idle cores measured at the start; a fixed count; with no policy,
    the cores this process may use."""
    return _installed.current() if _installed is not None else available_cores()
