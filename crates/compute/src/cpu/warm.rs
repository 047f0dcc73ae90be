//! A model step on the thread pool with the other workers kept polling for work until it ends.
//!
//! Why: rayon parks a worker that found nothing to do after a few dozen `sched_yield`s, and a
//! decode step has about a hundred parallel regions (four products and an attention per layer)
//! separated by short serial stretches (norms, activation quantization, the last share of a
//! region). On the dev box, a 2-vCPU Firecracker VM, `diskformer bench` of synth 1B Q4_0
//! (`-p 16 -n 64 -t 2`) decoded at 35-36 tok/s while the box was idle and at 38.5-40 tok/s
//! while compilers kept both vCPUs busy at a lower priority, with llama.cpp, whose threads spin
//! between ops, at 31-33 both ways; a perf profile of the idle run had each worker off the CPU
//! 9-13% of the time. Our reading: on an idle VM a parked worker's vCPU halts, and waking it for
//! the next region costs far more than a wake-up on bare metal. Keeping the workers polling for
//! the length of a step is what ggml's thread pool does. (Not yet measured: this change itself
//! on an idle box; the box stayed busy while it was made. `DISKFORMER_CPU_POLL=0` switches it
//! off for that A/B.)
//!
//! How: [`run_step`] runs the step on a pool worker (as `rayon::scope` did before) and spawns one
//! poller per other worker. A poller takes jobs with [`rayon::yield_now`] (its own deque, then
//! stealing), so it runs the step's parallel tasks exactly as an awake rayon worker would, and
//! returns when the step is over. Two guards keep it from blocking anything: a poller never runs
//! on the step's own thread or inside another poller (it returns at once), and it gives up after
//! [`MAX_IDLE`] without work, so a poller that a worker picked up while waiting inside a job
//! holds that job back only while the pool has other work for it, plus at most that long (the
//! thread then parks the usual way).
//!
//! A region can also reach the pollers directly ([`broadcast`]): its body is published in a
//! slot every poller of the step checks between polls, so each one runs it within about a
//! cache line's transfer, where 15 tasks spawned into one deque were stolen one at a time (on
//! the H200's 16-core host the split's CPU experts region saw its last task start 11-15 us in,
//! of a ~100 us region: thirty-fifth session, docs/NOTES.md).

use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a poller waits without finding work before it gives up. Decode's serial stretches
/// last microseconds to tens of microseconds; this only bounds the rare case of a poller
/// picked up by a thread that is waiting inside a job.
pub const MAX_IDLE: Duration = Duration::from_millis(2);

/// Empty polls between clock reads and `sched_yield`s: the yield lets another process have the
/// core on a busy machine without parking the thread.
const POLLS_PER_CHECK: u32 = 256;

/// A gap between two of a poller's clock reads longer than this is time off its core, not
/// idleness it saw ([`poll_until`]). The reads come every [`POLLS_PER_CHECK`] polls, tens to a
/// few hundred microseconds apart; the OS's time slices are milliseconds.
///
/// Why: a poller that the OS preempts for longer than [`MAX_IDLE`] (17 busy threads on 16 cores
/// in the split's decode: the host thread records while every pool worker polls) would give up
/// at its next read as if nothing had come for that long, and its worker would sleep for the
/// rest of the step, out of every region broadcast after. Whether that happens there is not
/// measured yet (`--stats` now counts the pollers that gave up). The give-ups seen so far were
/// not this kind: in the job test on the 2-vCPU dev box the one poller gave up after 26-36
/// thousand empty polls in 2 ms, on its core while no region came (the driver off its core?),
/// and the step's later broadcasts all fell back (thirty-seventh session). A poller whose
/// `sched_yield` gave its core to another process for that long restarts its count too: on a
/// machine busy with other work it gives up only after [`MAX_IDLE`] of its own polling (or
/// when the step ends).
const OFF_CORE_GAP: Duration = Duration::from_micros(1000);

/// Pollers that gave up, over the process (for `--stats`: [`poll_stats`]).
static GAVE_UP: AtomicU64 = AtomicU64::new(0);
/// Polled steps, those where a poller gave up, those where half or more did, and the sum of
/// the first give-ups' times into their steps in microseconds (for [`poll_stats`]).
static STEPS: AtomicU64 = AtomicU64::new(0);
static STEPS_LOSING_POLLERS: AtomicU64 = AtomicU64::new(0);
static STEPS_LOSING_BROADCASTS: AtomicU64 = AtomicU64::new(0);
static FIRST_GIVE_UP_US: AtomicU64 = AtomicU64::new(0);

/// How many step pollers gave up after [`MAX_IDLE`] without work since the process started:
/// each one's worker slept for the rest of its step, out of the step's broadcast regions.
pub fn pollers_gave_up() -> u64 {
    GAVE_UP.load(Ordering::Relaxed)
}

/// The polled steps' give-ups since the process started (`--stats`): where in a run pollers
/// give up tells whether it costs the decode (every step losing a few) or not (a few steps
/// losing them all: on the H200, the first steps after the load, thirty-eighth session).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PollStats {
    /// Steps run with pollers ([`run_step`]).
    pub steps: u64,
    /// Pollers that gave up, over all steps.
    pub pollers_gave_up: u64,
    /// Steps where at least one poller gave up.
    pub steps_losing_pollers: u64,
    /// Steps where half the pollers or more gave up: their later regions were spawned tasks.
    pub steps_losing_broadcasts: u64,
    /// Mean time from a losing step's start to its first give-up, in microseconds.
    pub first_give_up_mean_us: u64,
}

/// [`PollStats`] so far.
pub fn poll_stats() -> PollStats {
    let losing = STEPS_LOSING_POLLERS.load(Ordering::Relaxed);
    PollStats {
        steps: STEPS.load(Ordering::Relaxed),
        pollers_gave_up: GAVE_UP.load(Ordering::Relaxed),
        steps_losing_pollers: losing,
        steps_losing_broadcasts: STEPS_LOSING_BROADCASTS.load(Ordering::Relaxed),
        first_give_up_mean_us: FIRST_GIVE_UP_US.load(Ordering::Relaxed).checked_div(losing).unwrap_or(0),
    }
}

/// [`MAX_IDLE`], or 20 ms on the B steps of the A/B name `longidle` (a poller then outlasts
/// any wait inside a decode step: is a give-up a loss there?).
fn max_idle() -> Duration {
    if crate::ab::is_b("longidle") {
        Duration::from_millis(20)
    } else {
        MAX_IDLE
    }
}

thread_local! {
    /// True while this thread runs a poller (a nested one returns at once).
    static POLLING: Cell<bool> = const { Cell::new(false) };
    /// The running step's [`Slot`] while this thread is its driver or one of its pollers
    /// (null otherwise): where [`broadcast`] publishes a region.
    static SLOT: Cell<*const Slot> = const { Cell::new(std::ptr::null()) };
}

/// One step's broadcast slot: a region's body, published to the step's pollers.
///
/// The protocol (why a poller never calls a body that is gone): the publisher writes `body`
/// only while `epoch` is even (closed) and no poller is `inside`, then makes `epoch` odd
/// (open). A poller that sees an odd epoch first counts itself `inside`, then checks that the
/// epoch is still the one it saw, and only then reads `body`. The publisher, after its own
/// run, makes the epoch even and waits until nobody is `inside` before its body goes out of
/// scope. Both the poller's count-then-check and the publisher's close-then-wait are SeqCst,
/// so either the poller sees the close (and leaves without reading `body`) or the publisher
/// sees the poller inside (and waits for it).
struct Slot {
    epoch: AtomicU64,
    inside: AtomicUsize,
    /// Taken by the one region published at a time (a nested or concurrent one falls back).
    busy: AtomicBool,
    /// The open region's body, lifetime erased: valid while the epoch it was published under
    /// is open and until every poller inside has left (the protocol above).
    body: UnsafeCell<Option<*const (dyn Fn() + Sync)>>,
    /// The step's driver (its pool index), which runs the step and never polls.
    driver: Option<usize>,
    /// Pollers of the step that gave up after [`MAX_IDLE`] without work: their workers sleep
    /// until a task wakes them, which a published region never does.
    gave_up: AtomicUsize,
    /// When the step began, and microseconds from then to its first give-up (0: none yet).
    started: Instant,
    first_give_up_us: AtomicU64,
}

// SAFETY: `body` is written only by the publisher holding `busy` while no poller can read it,
// and read only under an open epoch (the protocol on `Slot`); the rest are atomics.
unsafe impl Sync for Slot {}

impl Slot {
    fn new(driver: Option<usize>) -> Slot {
        Slot {
            driver,
            epoch: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            body: UnsafeCell::new(None),
            gave_up: AtomicUsize::new(0),
            started: Instant::now(),
            first_give_up_us: AtomicU64::new(0),
        }
    }

    /// Counts a poller giving up at `now`.
    fn give_up(&self, now: Instant) {
        self.gave_up.fetch_add(1, Ordering::Relaxed);
        GAVE_UP.fetch_add(1, Ordering::Relaxed);
        let into_step = (now.saturating_duration_since(self.started).as_micros() as u64).max(1);
        let _ = self.first_give_up_us.compare_exchange(0, into_step, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Adds the ended step to the process's [`PollStats`].
    fn count_step(&self, pollers: usize) {
        STEPS.fetch_add(1, Ordering::Relaxed);
        let gave_up = self.gave_up.load(Ordering::Relaxed);
        if gave_up > 0 {
            STEPS_LOSING_POLLERS.fetch_add(1, Ordering::Relaxed);
            FIRST_GIVE_UP_US.fetch_add(self.first_give_up_us.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        if self.broadcasts_lost(pollers) {
            STEPS_LOSING_BROADCASTS.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether half or more of the step's `pollers` have given up: [`broadcast`] then falls
    /// back to spawned tasks, which wake the sleeping workers.
    fn broadcasts_lost(&self, pollers: usize) -> bool {
        2 * self.gave_up.load(Ordering::Relaxed) >= pollers.max(1)
    }

    /// Whether a region is published and not yet closed.
    fn is_open(&self) -> bool {
        !self.epoch.load(Ordering::Relaxed).is_multiple_of(2)
    }

    /// Runs the open region's body if there is one this poller has not run (`last_seen`).
    /// Returns whether it ran one.
    fn join(&self, last_seen: &mut u64) -> bool {
        let e = self.epoch.load(Ordering::Acquire);
        if e.is_multiple_of(2) || e == *last_seen {
            return false;
        }
        *last_seen = e;
        let _leave = LeaveOnDrop(&self.inside);
        self.inside.fetch_add(1, Ordering::SeqCst);
        if self.epoch.load(Ordering::SeqCst) != e {
            return false;
        }
        // SAFETY: the epoch is still the open one counted in above, so the publisher has not
        // passed its wait for `inside` and the body it wrote before opening is alive.
        let body = unsafe { (*self.body.get()).expect("an open region has a body") };
        // SAFETY: as above: the pointee outlives this call.
        unsafe { (*body)() };
        true
    }
}

/// Takes one off the count when dropped, so a body that unwinds still leaves the region.
struct LeaveOnDrop<'a>(&'a AtomicUsize);

impl Drop for LeaveOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Closes a published region and waits for the pollers inside it: the publisher's body must
/// outlive every call of it, also when the publisher's own call unwinds.
struct CloseOnDrop<'a>(&'a Slot);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        let slot = self.0;
        slot.epoch.fetch_add(1, Ordering::SeqCst);
        while slot.inside.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: closed with nobody inside: no poller reads `body` until the next open.
        unsafe { *slot.body.get() = None };
        slot.busy.store(false, Ordering::Release);
    }
}

/// Sets this thread's [`SLOT`] for as long as it lives, restoring the previous one after.
struct SlotScope(*const Slot);

impl SlotScope {
    fn enter(slot: &Slot) -> SlotScope {
        SlotScope(SLOT.with(|s| s.replace(slot)))
    }
}

impl Drop for SlotScope {
    fn drop(&mut self) {
        SLOT.with(|s| s.set(self.0));
    }
}

/// Runs `body` on this thread and on every poller of the running step that is idle now or
/// becomes idle before this thread's own call returns, and returns once every call has
/// returned: a parallel region without spawning tasks. Returns `false`, running nothing, when
/// this thread is not in a polled step ([`run_step`]), another region is published, or half
/// the step's pollers or more have given up (idle for [`MAX_IDLE`]): their workers sleep, and
/// only tasks the caller spawns instead wake them. (One poller gone costs a region one thread
/// of many; spawned tasks cost every thread a later start: ~7% of the split's CPU experts job
/// on the H200's host, thirty-fifth session.)
///
/// `body` must divide the work itself (claims from shared counters): any number of threads,
/// from one up, may run it, each once.
pub fn broadcast(body: &(dyn Fn() + Sync)) -> bool {
    let slot = SLOT.with(Cell::get);
    if slot.is_null() {
        return false;
    }
    // SAFETY: a non-null SLOT points at the running step's slot, which outlives the step's
    // driver and pollers, the only threads where it is set (`SlotScope`).
    let slot = unsafe { &*slot };
    if slot.broadcasts_lost(rayon::current_num_threads().saturating_sub(1)) {
        return false;
    }
    if slot.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        return false;
    }
    // SAFETY: `busy` is ours and the epoch is closed with nobody inside (the last close waited
    // for that), so no poller reads `body` now. The lifetime is erased only for the slot's
    // duration: `_close` waits out every call before `body` can go.
    unsafe {
        let erased: *const (dyn Fn() + Sync + '_) = body;
        *slot.body.get() = Some(std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const (dyn Fn() + Sync)>(erased));
    }
    slot.epoch.fetch_add(1, Ordering::Release);
    let _close = CloseOnDrop(slot);
    body();
    true
}

/// The pool threads a region published from this thread runs on, numbered `0..count()`: the
/// ranks by which a region's body gives each thread its own share of the work (the CPU experts'
/// owned rows, `quant::owned_bytes`, and the split's read-ahead of the same rows).
///
/// Why not the pool's thread indices: a region that a poller publishes (the split's
/// dispatcher) runs on the pollers only, not on the step's driver, which records the GPU's
/// next layers meanwhile. With shares over every index, the driver's share (a sixteenth of
/// every expert's rows on the H200's 16-thread host) was never read ahead and was computed by
/// thieves at the end of each phase, from RAM. So a poller's region ranks the pool without
/// the driver; a region the driver publishes (the CPU back end's steps), or one outside a
/// polled step, ranks every thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionRanks {
    count: usize,
    /// The pool index left out (the driver), when one is.
    skip: Option<usize>,
}

impl RegionRanks {
    /// The ranks of a region this thread would publish now.
    pub fn here() -> RegionRanks {
        let n = rayon::current_num_threads().max(1);
        let slot = SLOT.with(Cell::get);
        // SAFETY: a non-null SLOT points at the running step's slot, which outlives the step's
        // driver and pollers, the only threads where it is set (`SlotScope`).
        let driver = if slot.is_null() { None } else { unsafe { &*slot }.driver };
        match driver {
            Some(d) if n > 1 && d < n && rayon::current_thread_index() != Some(d) => {
                RegionRanks { count: n - 1, skip: Some(d) }
            }
            _ => RegionRanks { count: n, skip: None },
        }
    }

    /// [`RegionRanks::here`], or on the B steps of the A/B name `ranks` every pool thread ranked
    /// by its index (as before the thirty-ninth session, driver included).
    pub fn for_region() -> RegionRanks {
        if crate::ab::is_b("ranks") {
            RegionRanks { count: rayon::current_num_threads().max(1), skip: None }
        } else {
            RegionRanks::here()
        }
    }

    /// How many threads have a rank.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The rank of the thread with pool index `thread`. The thread left out, should it run the
    /// body after all (a region that fell back to spawned tasks), takes a neighbour's rank: its
    /// share is then shared, which claims allow.
    pub fn rank(&self, thread: usize) -> usize {
        let r = match self.skip {
            Some(d) if thread > d => thread - 1,
            _ => thread,
        };
        r.min(self.count - 1)
    }

    /// The calling thread's rank (0 outside the pool).
    pub fn current(&self) -> usize {
        self.rank(rayon::current_thread_index().unwrap_or(0))
    }
}

/// Sets the flag when dropped, so the pollers stop even if the step panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// False when the environment sets `DISKFORMER_CPU_POLL=0`: then [`run_step`] lets idle workers
/// park as rayon does (for A/B runs, or a machine shared with other work where the polling
/// cores are wanted elsewhere). Read once.
fn polling_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("DISKFORMER_CPU_POLL").map_or(true, |v| v.trim() != "0"))
}

/// Runs `step` on a worker of the current rayon pool while the pool's other workers poll for its
/// parallel tasks instead of parking between them; returns `step`'s value.
///
/// With one thread, or with polling switched off (`DISKFORMER_CPU_POLL=0`), it is
/// `rayon::scope` around `step`. Called from inside a pool worker, the step runs on that
/// worker.
pub fn run_step<R: Send>(step: impl FnOnce() -> R + Send) -> R {
    let n_threads = rayon::current_num_threads();
    if n_threads < 2 || !polling_enabled() {
        return rayon::scope(|_| step());
    }
    if rayon::current_thread_index().is_none() && !crate::ab::is_b("outsidestep") {
        // Called from outside the pool (the CLI's generation loop), `rayon::scope` would run the
        // step on a worker whose index is known only there: the step's slot would name no
        // driver (so `RegionRanks` could not leave it out), and once the pollers took their
        // driver from the slot (thirty-ninth session), that worker's own poller, still queued
        // for it, ran nested inside the step's first wait for a task (the logits' copy on the
        // pool) and held the step there until it gave up after `MAX_IDLE`: ~2.4 ms of every
        // ~14 ms split decode step on the H200 (fortieth session's trace). Enter the pool
        // first. (B steps of the A/B name `outsidestep` do not, for that comparison.)
        return rayon::scope(|_| run_step(step));
    }
    let done = AtomicBool::new(false);
    // `rayon::scope` runs its closure on this thread (a pool worker): the driver.
    let slot = Slot::new(rayon::current_thread_index());
    crate::trace::mark("step begins", None);
    let out = rayon::scope(|s| {
        let driver = slot.driver;
        let (done, slot) = (&done, &slot);
        // One poller on every worker (the driver's returns at once), each woken by rayon: 15
        // plain spawns into this thread's deque woke only the first few sleeping workers, and
        // those then took the other pollers' tasks (returning at once, being pollers already),
        // so on the H200's 16-core host a step ran with ~6 of 15 pollers and the other workers
        // asleep (thirty-fifth session).
        // (The A/B name `pollspawn` gives B steps the old spawns, for that comparison.)
        if crate::ab::is_b("pollspawn") {
            for _ in 1..n_threads {
                s.spawn(move |_| poll_until(done, slot, driver));
            }
        } else {
            s.spawn_broadcast(move |_, _| poll_until(done, slot, driver));
        }
        crate::trace::mark("pollers spawned", None);
        let _stop = StopOnDrop(done);
        let _slot = SlotScope::enter(slot);
        step()
    });
    slot.count_step(n_threads - 1);
    crate::trace::mark("pollers joined", None);
    out
}

/// How long a poller has polled without finding work, from its clock reads since the last
/// work: time between two reads further apart than [`OFF_CORE_GAP`] does not count (the thread
/// was off its core then).
#[derive(Default)]
struct IdleClock {
    idle_since: Option<Instant>,
    last_read: Option<Instant>,
}

impl IdleClock {
    /// Records a clock read at `now`; whether the poller has now been idle on its core for more
    /// than [`MAX_IDLE`].
    fn idle_too_long(&mut self, now: Instant) -> bool {
        if self.last_read.is_some_and(|at| now.saturating_duration_since(at) > OFF_CORE_GAP) {
            // Off its core since the last read: regions published meanwhile went to the others.
            self.idle_since = Some(now);
        }
        self.last_read = Some(now);
        now.saturating_duration_since(*self.idle_since.get_or_insert(now)) > max_idle()
    }
}

/// Takes pool jobs and `slot`'s regions until `done` is set or nothing came for [`MAX_IDLE`].
fn poll_until(done: &AtomicBool, slot: &Slot, driver: Option<usize>) {
    if rayon::current_thread_index() == driver || POLLING.with(Cell::get) {
        return;
    }
    POLLING.with(|p| p.set(true));
    crate::trace::mark("poller starts", None);
    let _slot = SlotScope::enter(slot);
    let mut idle = IdleClock::default();
    let mut empty_polls = 0u32;
    let mut last_region = 0u64;
    while !done.load(Ordering::Acquire) {
        if slot.join(&mut last_region) || matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
            idle = IdleClock::default();
            empty_polls = 0;
            continue;
        }
        empty_polls += 1;
        if empty_polls.is_multiple_of(POLLS_PER_CHECK) {
            // A region still open (this poller ran its share) will close when its publisher's
            // own share ends, and more work follows it: not idle. Without this, a publisher
            // held up for MAX_IDLE inside its share (off its core: the dev box's vCPUs saw
            // steal time, thirty-seventh session) would cost the step every poller that had
            // finished theirs.
            if slot.is_open() {
                idle = IdleClock::default();
            }
            let now = Instant::now();
            if idle.idle_too_long(now) {
                slot.give_up(now);
                crate::trace::mark("poller gave up", None);
                break;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    POLLING.with(|p| p.set(false));
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicUsize;

    fn pool(n: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap()
    }

    /// The running step's pollers that gave up so far (0 outside a step).
    fn gave_up() -> usize {
        let slot = SLOT.with(Cell::get);
        // SAFETY: a non-null SLOT points at the running step's slot (as in `broadcast`).
        unsafe { slot.as_ref() }.map_or(0, |s| s.gave_up.load(Ordering::Relaxed))
    }

    /// Called from outside the pool, a step runs on a worker that is its driver: that worker's
    /// own poller, still queued for it, returns at once instead of running nested inside the
    /// step's first wait for a stolen task, where it held the step until it gave up after
    /// `MAX_IDLE` (every split decode step on the H200 until the fortieth session).
    #[test]
    fn a_step_from_outside_the_pool_is_driven_by_its_worker() {
        assert!(rayon::current_thread_index().is_none(), "the test thread is outside the global pool");
        if rayon::current_num_threads() < 2 {
            return;
        }
        let started_elsewhere = AtomicBool::new(false);
        let (driver_is_worker, stolen, gave_up_in_step) = run_step(|| {
            let me = rayon::current_thread_index();
            // The second half sleeps on another thread (a poller steals it) while this one, its
            // own half done, must wait for it: rayon then looks for other work on this thread.
            let (stolen, ()) = rayon::join(
                || {
                    let t = Instant::now();
                    while !started_elsewhere.load(Ordering::Acquire) && t.elapsed() < Duration::from_secs(2) {
                        std::hint::spin_loop();
                    }
                    started_elsewhere.load(Ordering::Acquire)
                },
                || {
                    if rayon::current_thread_index() != me {
                        started_elsewhere.store(true, Ordering::Release);
                        std::thread::sleep(Duration::from_millis(5));
                    }
                },
            );
            (me.is_some(), stolen, gave_up())
        });
        assert!(driver_is_worker, "the step ran outside the pool");
        if stolen {
            assert_eq!(gave_up_in_step, 0, "a poller gave up inside the step's wait");
        }
    }

    /// A region's ranks: every thread outside a step and in a region the driver publishes; in
    /// one a poller publishes (the split's dispatcher), the pollers only, numbered `0..n - 1`
    /// without a gap, the driver's index mapped into that range too.
    #[test]
    fn ranks_leave_out_the_driver_when_a_poller_publishes() {
        let n = 4;
        let p = pool(n);
        assert_eq!(p.install(RegionRanks::here), RegionRanks { count: n, skip: None }, "outside a step");
        let (driver, from_driver, from_poller) = p.install(|| {
            run_step(|| {
                let driver = rayon::current_thread_index().unwrap();
                let from_driver = RegionRanks::here();
                // A task a poller takes while the driver waits for it.
                let (tx, rx) = std::sync::mpsc::channel();
                rayon::spawn(move || {
                    let _ = tx.send((rayon::current_thread_index().unwrap(), RegionRanks::here()));
                });
                let (poller, ranks) = rx.recv_timeout(Duration::from_secs(10)).expect("a poller took the task");
                assert_ne!(poller, driver);
                (driver, from_driver, ranks)
            })
        });
        assert_eq!(from_driver, RegionRanks { count: n, skip: None }, "published by the driver");
        assert_eq!(from_poller, RegionRanks { count: n - 1, skip: Some(driver) }, "published by a poller");
        let mut ranks: Vec<usize> = (0..n).filter(|&t| t != driver).map(|t| from_poller.rank(t)).collect();
        ranks.sort_unstable();
        assert_eq!(ranks, (0..n - 1).collect::<Vec<_>>());
        assert!(from_poller.rank(driver) < n - 1);
    }

    /// Nested parallel work inside a step gives the serial result on pools of 1 to 4 threads,
    /// and steps follow one another (each one's pollers end).
    #[test]
    fn nested_parallel_work_completes() {
        for n in 1..=4 {
            let p = pool(n);
            for round in 0..20u64 {
                let got: u64 = p.install(|| {
                    run_step(|| {
                        (0..64u64)
                            .into_par_iter()
                            .map(|i| (0..2000u64).into_par_iter().map(|j| (i * j + round) % 7).sum::<u64>() + i)
                            .sum()
                    })
                });
                let want: u64 = (0..64u64).map(|i| (0..2000u64).map(|j| (i * j + round) % 7).sum::<u64>() + i).sum();
                assert_eq!(got, want, "{n} threads, round {round}");
            }
        }
    }

    /// The other workers take the step's tasks: on 2 and 3 threads, tasks that wait for each
    /// other (up to 10 s) all meet, so they ran at the same time on different threads.
    #[test]
    fn other_workers_run_tasks_of_the_step() {
        for n in 2..=3 {
            let p = pool(n);
            let arrived = AtomicUsize::new(0);
            let met = p.install(|| {
                run_step(|| {
                    (0..n).into_par_iter().all(|_| {
                        arrived.fetch_add(1, Ordering::AcqRel);
                        let t0 = Instant::now();
                        while arrived.load(Ordering::Acquire) < n {
                            if t0.elapsed() > Duration::from_secs(10) {
                                return false;
                            }
                            std::hint::spin_loop();
                        }
                        true
                    })
                })
            });
            assert!(met, "{n} threads: only {} of {n} tasks ran at once", arrived.load(Ordering::Acquire));
        }
    }

    /// Outside a step (or in a one-thread step, which has no pollers) there is nobody to
    /// broadcast to; inside one, on pools of 2 to 4 threads, a region's items are each done
    /// once, every worker joins (a body that waits for all of them meets them: a step spawned
    /// its pollers into one deque before, and sleeping workers missed them), and regions follow
    /// one another.
    #[test]
    fn broadcast_regions_reach_the_pollers() {
        assert!(!broadcast(&|| ()), "broadcast outside a step");
        assert!(!pool(1).install(|| run_step(|| broadcast(&|| ()))), "broadcast in a one-thread step");
        for n in [2, 3, 4, 8] {
            let p = pool(n);
            // Time for the new workers to park (rayon's idle threads sleep after a few rounds).
            std::thread::sleep(Duration::from_millis(50));
            let (most, all_done) = p.install(|| {
                run_step(|| {
                    let mut most = 0;
                    let mut all_done = true;
                    let first_met = AtomicBool::new(false);
                    for round in 0..200 {
                        let (next, callers, done) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0));
                        let items = 64 + round;
                        let ran = broadcast(&|| {
                            callers.fetch_add(1, Ordering::AcqRel);
                            // The first round waits (up to 5 s) for every worker.
                            let t0 = Instant::now();
                            while round == 0 && callers.load(Ordering::Acquire) < n {
                                if t0.elapsed() > Duration::from_secs(5) {
                                    return;
                                }
                                std::hint::spin_loop();
                            }
                            if round == 0 {
                                first_met.store(true, Ordering::Release);
                            }
                            while next.fetch_add(1, Ordering::AcqRel) < items {
                                done.fetch_add(1, Ordering::AcqRel);
                            }
                        });
                        // Pollers descheduled past MAX_IDLE on this oversubscribed pool may give
                        // up (then regions fall back); never in the first round.
                        if !ran && round > 0 && 2 * gave_up() >= n - 1 {
                            break;
                        }
                        assert!(ran, "{n} threads: a step's broadcast fell back in round {round}");
                        all_done &= round == 0 || done.load(Ordering::Acquire) == items;
                        most = most.max(callers.load(Ordering::Acquire));
                        // A broadcast inside a broadcast's body falls back (one region at a time).
                        let second = broadcast(&|| assert!(!broadcast(&|| ())));
                        assert!(second || 2 * gave_up() >= n - 1, "a second region after the first");
                    }
                    (most, all_done && first_met.load(Ordering::Acquire))
                })
            });
            assert!(all_done, "{n} threads: an item done twice or never, or the first region's callers never met");
            assert!(most <= n, "{n} threads: {most} callers of one region");
            // The pool's workers were asleep when the step began (parked after `pool`'s start):
            // every one of them must have become a poller.
            assert_eq!(most, n, "{n} threads: only {most} callers of one region");
        }
    }

    /// Once half the pollers or more have given up (the step idle past `MAX_IDLE`: here both of
    /// a 3-thread pool's), regions fall back to spawned tasks, which wake the sleeping workers,
    /// and their work is still all done; the next step broadcasts again.
    #[test]
    fn regions_fall_back_once_a_poller_gave_up() {
        let p = pool(3);
        // Other tests' steps may count too (the counters are the process's): at least.
        let before = poll_stats();
        p.install(|| {
            run_step(|| {
                // Every poller gives up within MAX_IDLE of polling nothing (waited for up to
                // 5 s: on a loaded machine a poller may start late).
                let t0 = Instant::now();
                while gave_up() < 2 && t0.elapsed() < Duration::from_secs(5) {
                    std::thread::sleep(MAX_IDLE);
                }
                assert_eq!(gave_up(), 2, "both pollers gave up");
                let items = AtomicUsize::new(0);
                assert!(!broadcast(&|| ()), "a region broadcast to pollers that gave up");
                (0..100).into_par_iter().for_each(|_| {
                    items.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(items.load(Ordering::Relaxed), 100);
            })
        });
        let after = poll_stats();
        assert!(after.steps > before.steps, "the step counted");
        assert!(after.pollers_gave_up >= before.pollers_gave_up + 2, "{before:?} then {after:?}");
        assert!(after.steps_losing_broadcasts > before.steps_losing_broadcasts, "{before:?} then {after:?}");
        assert!(after.first_give_up_mean_us >= 1, "the first give-up came into the step: {after:?}");
        assert!(p.install(|| run_step(|| broadcast(&|| ()))), "the next step's pollers");
    }

    /// Pollers that ran their share of a region do not give up while its publisher is still in
    /// its own (here for three times MAX_IDLE), and take the next region.
    #[test]
    fn pollers_wait_out_a_long_region() {
        let p = pool(3);
        p.install(|| {
            run_step(|| {
                let publisher = std::thread::current().id();
                let ran = AtomicUsize::new(0);
                assert!(broadcast(&|| {
                    ran.fetch_add(1, Ordering::AcqRel);
                    if std::thread::current().id() == publisher {
                        std::thread::sleep(3 * MAX_IDLE);
                    }
                }));
                assert_eq!(gave_up(), 0, "a poller gave up while the region was open");
                assert!(ran.load(Ordering::Acquire) >= 1);
                let after = AtomicUsize::new(0);
                assert!(broadcast(&|| {
                    after.fetch_add(1, Ordering::AcqRel);
                }));
            })
        });
    }

    /// A poller's idle time counts only while it polls: reads every 100 us give up just past
    /// MAX_IDLE, a gap of several milliseconds between two reads (the thread off its core)
    /// starts the count again, and a fresh clock (after work) starts from nothing.
    #[test]
    fn idle_time_off_the_core_does_not_count() {
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        let reads_until_give_up = |clock: &mut IdleClock, from_us: u64| {
            (0..1000u64).map(|i| from_us + 100 * i).find(|&us| clock.idle_too_long(at(us)))
        };
        let mut polling = IdleClock::default();
        let gave_up_at = reads_until_give_up(&mut polling, 0).expect("gives up");
        assert!(gave_up_at > MAX_IDLE.as_micros() as u64, "gave up at {gave_up_at} us");
        assert!(gave_up_at <= MAX_IDLE.as_micros() as u64 + 100, "gave up late, at {gave_up_at} us");

        let mut preempted = IdleClock::default();
        assert!(!preempted.idle_too_long(at(0)));
        assert!(!preempted.idle_too_long(at(100)));
        // Five milliseconds off the core: not idleness the poller saw.
        assert!(!preempted.idle_too_long(at(5100)), "gave up on time spent off the core");
        let gave_up_at = reads_until_give_up(&mut preempted, 5200).expect("gives up");
        assert!(gave_up_at > 5100 + MAX_IDLE.as_micros() as u64, "gave up at {gave_up_at} us");
    }

    /// A body that panics on a poller still lets the region close, and the panic reaches the
    /// step's caller; the pool works afterwards.
    #[test]
    fn a_panicking_region_body_reaches_the_caller() {
        let p = pool(3);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.install(|| {
                run_step(|| {
                    let publisher = std::thread::current().id();
                    let callers = AtomicUsize::new(0);
                    broadcast(&|| {
                        callers.fetch_add(1, Ordering::AcqRel);
                        if std::thread::current().id() != publisher {
                            panic!("body failed");
                        }
                        // The publisher waits (up to 10 s) for a poller to come and fail.
                        let t0 = Instant::now();
                        while callers.load(Ordering::Acquire) < 2 && t0.elapsed() < Duration::from_secs(10) {
                            std::hint::spin_loop();
                        }
                    })
                })
            })
        }));
        assert!(result.is_err(), "the poller's panic was lost");
        let ran = AtomicUsize::new(0);
        p.install(|| {
            run_step(|| {
                broadcast(&|| {
                    ran.fetch_add(1, Ordering::Relaxed);
                })
            })
        });
        assert!(ran.load(Ordering::Relaxed) >= 1);
    }

    /// A step that panics still ends its pollers, and the panic reaches the caller.
    #[test]
    fn a_panicking_step_stops_the_pollers() {
        let p = pool(3);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.install(|| run_step(|| -> u32 { panic!("step failed") }))
        }));
        assert!(result.is_err());
        // The pool is usable afterwards (pollers did not keep its workers).
        let ran = AtomicUsize::new(0);
        p.install(|| {
            run_step(|| {
                (0..100).into_par_iter().for_each(|_| {
                    ran.fetch_add(1, Ordering::Relaxed);
                })
            })
        });
        assert_eq!(ran.load(Ordering::Relaxed), 100);
    }
}
