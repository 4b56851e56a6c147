//! Claim renewals on a thread of their own: load on the node cannot starve them.
//!
//! A self-fencing lease protects its renewals above everything else on the machine (sanlock
//! and Pacemaker renew from a watchdog-priority daemon). Here the renewals run on one OS
//! thread, `dhv-renewals`, with its own current-thread runtime and its own connection to
//! Nomad, at a raised scheduling priority where the agent may raise it (`nice` −10,
//! `setpriority(2)` on the thread; the agent's cgroup needs a `cpu.weight` of its own to
//! compete with the tasks' cgroups, docs/operations/claims.md "A loaded node"). They are never
//! queued behind plugin calls, status documents, record reads or the core's planning: the
//! core only says which claims to renew ([`Order`]) and hears each outcome
//! ([`Completion::ClaimRenewed`], with when the renewal was *sent*: the lease counts from
//! there, [`crate::agent::claims`]).
//!
//! **Scale.** Each claim is renewed every TTL/3 on its own phase ([`Schedule`]): a new
//! claim's first renewal comes a fraction of the interval after its acquire (a golden-ratio
//! sequence spreads any number of claims evenly), and sends are paced at most twice the
//! steady rate (one every `TTL/3 / (2 x claims)`), so a backlog after a stall is sent spread
//! over half an interval, not as a burst. Renewals go one at a time over one kept-alive
//! connection: N claims cost N / (TTL/3) requests per second (200 claims: 40/s; 1,000:
//! 200/s; docs/scale.md "Claim renewals"). A renewal that takes longer than the interval is
//! abandoned (its connection dropped) and retried after half an interval.

use crate::agent::executor::Completion;
use crate::cluster::claims::{self, ClaimError, ClaimSettings};
use crate::cluster::trust::RecordTrust;
use crate::node::clock::BootClock;
use crate::nomad::Client;
use crate::volume::VolumeKey;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The `nice` value the renewal thread asks for (needs `CAP_SYS_NICE`, as the agent has when
/// it runs as root; else it keeps the agent's).
pub(crate) const RENEWAL_NICE: i32 = -10;

/// What the core tells the renewal thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Order {
    /// Renew this claim every TTL/3 until told to stop (or until a renewal finds it lost
    /// or released). `at_once`: renew now (a claim restored after a restart, whose lease's
    /// end is unknown), else on a spread phase within the first interval.
    Keep {
        volume: VolumeKey,
        lock_id: String,
        acquired_index: Option<u64>,
        at_once: bool,
    },
    /// Stop renewing this volume's claim (released, lost, forgotten).
    Stop { volume: VolumeKey },
}

#[derive(Debug, Clone)]
struct Entry {
    lock_id: String,
    acquired_index: Option<u64>,
    due: Instant,
}

/// One renewal to send now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Due {
    pub volume: VolumeKey,
    pub lock_id: String,
    pub acquired_index: Option<u64>,
}

/// When each claim is renewed (no I/O: the thread's loop asks it).
#[derive(Debug)]
pub(crate) struct Schedule {
    every: Duration,
    claims: BTreeMap<VolumeKey, Entry>,
    /// (due, volume), the same moments as in `claims`: the earliest first.
    queue: BTreeSet<(Instant, VolumeKey)>,
    /// The claims added so far (the golden-ratio sequence's index).
    added: u64,
    /// When the last renewal was sent (the pace counts from it).
    last_sent: Option<Instant>,
}

/// The fractional part of the golden ratio: `k x PHI mod 1` for k = 1, 2, … spreads points
/// evenly over [0, 1) however many there are.
const PHI_FRACTION: f64 = 0.618_033_988_749_895;

impl Schedule {
    /// A schedule renewing every `every` (TTL/3).
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            claims: BTreeMap::new(),
            queue: BTreeSet::new(),
            added: 0,
            last_sent: None,
        }
    }

    /// The claims being renewed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.claims.len()
    }

    fn set_due(&mut self, volume: &VolumeKey, due: Instant) {
        if let Some(e) = self.claims.get_mut(volume) {
            self.queue.remove(&(e.due, volume.clone()));
            e.due = due;
            self.queue.insert((due, volume.clone()));
        }
    }

    /// Applies an order at `now`.
    pub(crate) fn order(&mut self, order: Order, now: Instant) {
        match order {
            Order::Keep {
                volume,
                lock_id,
                acquired_index,
                at_once,
            } => {
                if self
                    .claims
                    .get(&volume)
                    .is_some_and(|e| e.lock_id == lock_id)
                {
                    return;
                }
                self.stop(&volume);
                self.added += 1;
                let due = if at_once {
                    now
                } else {
                    // Within (0, every]: never later than a renewal at TTL/3 would be.
                    let phase = (self.added as f64 * PHI_FRACTION).fract();
                    now + self.every.mul_f64(phase.max(0.05))
                };
                self.claims.insert(
                    volume.clone(),
                    Entry {
                        lock_id,
                        acquired_index,
                        due,
                    },
                );
                self.queue.insert((due, volume));
            }
            Order::Stop { volume } => self.stop(&volume),
        }
    }

    fn stop(&mut self, volume: &VolumeKey) {
        if let Some(e) = self.claims.remove(volume) {
            self.queue.remove(&(e.due, volume.clone()));
        }
    }

    /// The least time between two sends: the steady rate is one per `every / claims`; a
    /// backlog is sent at twice that.
    fn pace(&self) -> Duration {
        let n = self.claims.len().max(1) as u32;
        self.every / (2 * n)
    }

    /// When the next renewal may be sent (`None`: no claim).
    pub(crate) fn next_at(&self) -> Option<Instant> {
        let (due, _) = self.queue.first()?;
        Some(match self.last_sent {
            Some(t) => (*due).max(t + self.pace()),
            None => *due,
        })
    }

    /// The renewal to send at `now`, if one is due and the pace allows; it is marked sent
    /// (not due again until [`Schedule::done`]).
    pub(crate) fn take(&mut self, now: Instant) -> Option<Due> {
        if self.next_at()? > now {
            return None;
        }
        let (due, volume) = self.queue.pop_first()?;
        let e = self.claims.get_mut(&volume)?;
        // Parked far ahead until its outcome reschedules it.
        let parked = due.max(now) + self.every * 1000;
        e.due = parked;
        self.queue.insert((parked, volume.clone()));
        self.last_sent = Some(now);
        Some(Due {
            volume,
            lock_id: e.lock_id.clone(),
            acquired_index: e.acquired_index,
        })
    }

    /// A renewal of `lock_id` sent at `sent` ended with `result`: the next one is due an
    /// interval after it was sent, or after half an interval when it failed; a claim found
    /// lost or released is no longer renewed.
    pub(crate) fn done(
        &mut self,
        volume: &VolumeKey,
        lock_id: &str,
        sent: Instant,
        result: &Result<(), ClaimError>,
    ) {
        if self.claims.get(volume).is_none_or(|e| e.lock_id != lock_id) {
            return;
        }
        match result {
            Ok(()) => self.set_due(volume, sent + self.every),
            Err(ClaimError::Lost { .. } | ClaimError::ReleasedByOperator { .. }) => {
                self.stop(volume)
            }
            Err(_) => self.set_due(volume, sent + self.every / 2),
        }
    }
}

/// The last renewal that succeeded, per volume: (lock ID, when it was sent), written by the
/// renewal thread the moment its answer arrives. The fence reads it right before it kills
/// anything ([`crate::agent::effect::Effect::Fence`]): the freshest evidence this node has
/// that the servers still hold the claim for it. It is also kept on disk for a restart on
/// the same boot ([`crate::node::leases`], [`Evidence::keep_on_disk`]). Cheap to clone:
/// clones share the record.
#[derive(Debug, Clone, Default)]
pub(crate) struct Evidence(Arc<(Mutex<Renewals>, Condvar)>);

#[derive(Debug, Default)]
struct Renewals {
    last: HashMap<VolumeKey, (String, Instant)>,
    /// Moves with every change of `last` (the disk writer waits for it to move).
    version: u64,
    /// No more writes: the agent is stopping.
    closed: bool,
}

impl Evidence {
    fn change(&self, f: impl FnOnce(&mut HashMap<VolumeKey, (String, Instant)>)) {
        let (m, changed) = &*self.0;
        let mut r = m.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut r.last);
        r.version += 1;
        changed.notify_all();
    }

    fn record(&self, volume: &VolumeKey, lock_id: &str, sent: Instant) {
        self.change(|m| {
            m.insert(volume.clone(), (lock_id.to_string(), sent));
        });
    }

    /// A claim restored after a restart whose last renewal that succeeded was sent at
    /// `sent` (read from [`crate::node::leases`]).
    pub(crate) fn restored(&self, volume: &VolumeKey, lock_id: &str, sent: Instant) {
        self.record(volume, lock_id, sent);
    }

    /// The claim on `volume` is no longer renewed here (released, lost or replaced).
    fn forget(&self, volume: &VolumeKey) {
        self.change(|m| {
            m.remove(volume);
        });
    }

    /// Keeps the record in `file` for a restart on the same boot: a thread of its own
    /// writes it whenever it changed, at most once per [`crate::node::leases::WRITE_EVERY`]
    /// (a slow state disk never delays a renewal). Ages are measured on `clock`. A failed
    /// write is logged once until a write succeeds again. The thread ends with
    /// [`Evidence::close`]. Errors when the thread cannot be made.
    pub(crate) fn keep_on_disk(
        &self,
        file: crate::node::leases::LeaseFile,
        clock: BootClock,
    ) -> std::io::Result<()> {
        let ev = self.clone();
        std::thread::Builder::new()
            .name("dhv-leases".into())
            .spawn(move || {
                let mut written = 0;
                let mut failing = false;
                loop {
                    let snapshot = {
                        let (m, changed) = &*ev.0;
                        let mut r = m.lock().unwrap_or_else(|e| e.into_inner());
                        while r.version == written && !r.closed {
                            r = changed.wait(r).unwrap_or_else(|e| e.into_inner());
                        }
                        if r.closed {
                            return;
                        }
                        written = r.version;
                        r.last.clone()
                    };
                    let now = clock.at(Instant::now());
                    let claims = snapshot.iter().map(|(k, (id, sent))| {
                        (k, id.as_str(), now.saturating_duration_since(*sent))
                    });
                    match file.write(claims) {
                        Ok(()) => failing = false,
                        Err(e) if !failing => {
                            failing = true;
                            tracing::warn!(error = %e, "cannot keep the claims' renewals on disk");
                        }
                        Err(_) => {}
                    }
                    std::thread::sleep(crate::node::leases::WRITE_EVERY);
                }
            })?;
        Ok(())
    }

    /// Ends the disk writer of [`Evidence::keep_on_disk`].
    pub(crate) fn close(&self) {
        let (m, changed) = &*self.0;
        m.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        changed.notify_all();
    }

    /// When the last renewal of `lock_id` on `volume` that succeeded was sent.
    pub(crate) fn last_success(&self, volume: &VolumeKey, lock_id: &str) -> Option<Instant> {
        let r = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        r.last
            .get(volume)
            .filter(|(id, _)| id == lock_id)
            .map(|(_, sent)| *sent)
    }

    /// The renewal that keeps the claim under `lock_id` beyond its fence moment at `now`,
    /// if one succeeded: its sending (the lease ends `2 x TTL + lock delay` after it, and
    /// the fence comes the margin before that; docs/architecture.md, "Fencing").
    pub(crate) fn withdraws_fence(
        &self,
        volume: &VolumeKey,
        lock_id: &str,
        settings: &ClaimSettings,
        now: Instant,
    ) -> Option<Instant> {
        let sent = self.last_success(volume, lock_id)?;
        let end = sent + settings.ttl * 2 + settings.lock_delay;
        let fence_at = end.checked_sub(settings.fence_margin).unwrap_or(end);
        (now < fence_at).then_some(sent)
    }
}

/// The handle of the renewal thread: orders go in; outcomes come back on the channel given
/// to [`Renewer::start`]. The thread ends when the handle is dropped.
#[derive(Debug)]
pub(crate) struct Renewer {
    orders: mpsc::UnboundedSender<Order>,
}

impl Renewer {
    /// Starts the thread. `client` must be a client of its own (its own connections: a
    /// client's connections are driven by the runtime that opened them, and the loop's
    /// runtime is the one load may starve). Outcomes, with the moment each renewal was sent
    /// on `clock`, go to `outcomes`. Errors when the thread or its runtime cannot be made.
    pub(crate) fn start(
        client: Client,
        trust: RecordTrust,
        node_id: String,
        settings: ClaimSettings,
        clock: BootClock,
        evidence: Evidence,
        outcomes: mpsc::UnboundedSender<Completion>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("dhv-renewals".into())
            .spawn(move || {
                raise_priority();
                let every = settings.ttl / 3;
                let ctx = Context {
                    client,
                    trust,
                    node_id,
                    every,
                    clock,
                    evidence,
                };
                rt.block_on(run(ctx, rx, outcomes));
            })?;
        Ok(Self { orders: tx })
    }

    /// Sends an order (ignored once the thread has ended: the agent is stopping).
    pub(crate) fn order(&self, order: Order) {
        let _ = self.orders.send(order);
    }
}

/// Asks for [`RENEWAL_NICE`] for the calling thread (Linux applies `setpriority(2)` with a
/// thread ID to that thread alone).
fn raise_priority() {
    let tid = nix::unistd::gettid().as_raw();
    let pid = rustix::process::Pid::from_raw(tid);
    match rustix::process::setpriority_process(pid, RENEWAL_NICE) {
        Ok(()) => tracing::debug!(
            nice = RENEWAL_NICE,
            "claim renewals run at a raised priority"
        ),
        Err(e) => {
            tracing::info!(error = %e, nice = RENEWAL_NICE, "cannot raise the priority of the claim renewals (needs CAP_SYS_NICE); give the agent's cgroup a cpu.weight of its own (docs/operations/claims.md \"A loaded node\")")
        }
    }
}

/// What the renewal thread works with.
struct Context {
    client: Client,
    trust: RecordTrust,
    node_id: String,
    every: Duration,
    clock: BootClock,
    evidence: Evidence,
}

async fn run(
    ctx: Context,
    mut orders: mpsc::UnboundedReceiver<Order>,
    outcomes: mpsc::UnboundedSender<Completion>,
) {
    let Context {
        client,
        trust,
        node_id,
        every,
        clock,
        evidence,
    } = ctx;
    let now = || clock.at(Instant::now());
    let apply = |schedule: &mut Schedule, o: Order| {
        if let Order::Stop { volume } = &o {
            evidence.forget(volume);
        }
        schedule.order(o, now());
    };
    let mut schedule = Schedule::new(every);
    loop {
        // Every order waiting first: a stop must not be overtaken by a renewal.
        loop {
            match orders.try_recv() {
                Ok(o) => apply(&mut schedule, o),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            }
        }
        if let Some(due) = schedule.take(now()) {
            let sent = now();
            let result = match tokio::time::timeout(
                every,
                claims::renew(
                    &client,
                    &trust,
                    &due.volume,
                    &due.lock_id,
                    &node_id,
                    due.acquired_index,
                ),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(ClaimError::Nomad {
                    volume: due.volume.clone(),
                    source: crate::nomad::NomadError::Status {
                        what: "lock-renew".into(),
                        status: 0,
                        body: format!("no answer within {every:?}; abandoned, retried"),
                    },
                }),
            };
            if result.is_ok() {
                evidence.record(&due.volume, &due.lock_id, sent);
            }
            schedule.done(&due.volume, &due.lock_id, sent, &result);
            let report = Completion::ClaimRenewed {
                volume: due.volume,
                lock_id: due.lock_id,
                sent,
                result,
            };
            if outcomes.send(report).is_err() {
                return;
            }
            continue;
        }
        let wake = schedule
            .next_at()
            .map(|t| tokio::time::Instant::from_std(clock.monotonic(t)));
        tokio::select! {
            o = orders.recv() => match o {
                Some(o) => apply(&mut schedule, o),
                None => return,
            },
            _ = sleep_until(wake) => {}
        }
    }
}

async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: usize) -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: format!("v{i}").into(),
        }
    }

    fn keep(i: usize, at_once: bool) -> Order {
        Order::Keep {
            volume: key(i),
            lock_id: format!("lock-{i}"),
            acquired_index: None,
            at_once,
        }
    }

    /// Sends everything due until `until`, each renewal answered at once with success;
    /// returns the send moments.
    fn run_until(s: &mut Schedule, from: Instant, until: Instant) -> Vec<(Instant, VolumeKey)> {
        let mut sent = Vec::new();
        let mut t = from;
        while let Some(next) = s.next_at() {
            t = t.max(next);
            if t >= until {
                break;
            }
            let d = s.take(t).expect("due");
            s.done(&d.volume, &d.lock_id, t, &Ok(()));
            sent.push((t, d.volume));
        }
        sent
    }

    /// Issue 50: 200 claims taken in one burst are renewed spread over the interval: every
    /// claim once per TTL/3, and no second of the interval carries more than twice its share.
    #[test]
    fn claims_taken_together_are_renewed_spread_over_the_interval() {
        let every = Duration::from_secs(5);
        let t0 = Instant::now();
        let mut s = Schedule::new(every);
        for i in 0..200 {
            s.order(keep(i, false), t0);
        }
        // Past the first interval, one steady interval.
        let sent = run_until(&mut s, t0, t0 + every * 3);
        let steady: Vec<_> = sent
            .iter()
            .filter(|(t, _)| *t >= t0 + every * 2 && *t < t0 + every * 3)
            .collect();
        let claims: BTreeSet<_> = steady.iter().map(|(_, v)| v.clone()).collect();
        assert_eq!(claims.len(), 200, "each claim renewed in the interval");
        assert_eq!(steady.len(), 200, "once each");
        let mut per_second = [0usize; 5];
        for (t, _) in &steady {
            per_second[(*t - (t0 + every * 2)).as_secs() as usize] += 1;
        }
        assert!(per_second.iter().all(|n| *n <= 80), "{per_second:?}");
        // Each first renewal within the first interval: no lease is put at risk by spreading.
        let firsts: BTreeMap<_, _> = sent.iter().rev().map(|(t, v)| (v.clone(), *t)).collect();
        assert!(firsts.values().all(|t| *t <= t0 + every), "{firsts:?}");
    }

    /// A backlog (a stall of the whole machine) is sent paced, at twice the steady rate, and
    /// is spread afterwards.
    #[test]
    fn a_backlog_is_sent_paced_and_spreads() {
        let every = Duration::from_secs(5);
        let t0 = Instant::now();
        let mut s = Schedule::new(every);
        for i in 0..100 {
            s.order(keep(i, true), t0);
        }
        let sent = run_until(&mut s, t0, t0 + every);
        let gaps: Vec<Duration> = sent.windows(2).map(|w| w[1].0 - w[0].0).collect();
        assert!(gaps.iter().all(|g| *g >= every / 200), "{gaps:?}");
        assert_eq!(
            sent.len(),
            100,
            "the backlog sent within half an interval and more"
        );
    }

    /// The fence's evidence: a renewal of the same lock that succeeded, sent late enough
    /// that the lease outlives the fence moment (sent + 2 x TTL + lock delay − margin).
    #[test]
    fn a_renewal_that_succeeded_withdraws_a_fence_only_while_it_keeps_the_lease() {
        let s = Duration::from_secs;
        let settings = ClaimSettings {
            ttl: s(15),
            lock_delay: s(15),
            fence_margin: s(15),
        };
        let t0 = Instant::now();
        let ev = Evidence::default();
        assert_eq!(ev.withdraws_fence(&key(1), "lock-1", &settings, t0), None);
        ev.record(&key(1), "lock-1", t0);
        assert_eq!(
            ev.withdraws_fence(&key(1), "lock-1", &settings, t0 + s(29)),
            Some(t0)
        );
        assert_eq!(
            ev.withdraws_fence(&key(1), "lock-1", &settings, t0 + s(30)),
            None
        );
        assert_eq!(
            ev.withdraws_fence(&key(1), "lock-2", &settings, t0 + s(1)),
            None,
            "another lock's renewal is no evidence"
        );
    }

    /// Issue 50: the renewal thread renews every claim over one kept-alive connection, one
    /// request at a time, and reports each outcome with its sending. Against a fake Nomad
    /// that answers every renewal at once; prints the requests per second of the last
    /// interval. The figures of docs/scale.md ("Claim renewals") come from
    /// `RENEWER_CLAIMS=1000 RENEWER_TTL_SECS=15 cargo test --lib renewer::tests::renewals -- --nocapture`
    /// (defaults: 200 claims, TTL 3 s, three intervals).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn renewals_go_one_at_a_time_over_one_connection() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
        let env = |k: &str, d: u64| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        let n = env("RENEWER_CLAIMS", 200) as usize;
        let ttl = Duration::from_secs(env("RENEWER_TTL_SECS", 3));
        let every = ttl / 3;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (conns, reqs) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let stamps = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let (c2, r2, s2) = (conns.clone(), reqs.clone(), stamps.clone());
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = l.accept().await else {
                    return;
                };
                c2.fetch_add(1, Ordering::SeqCst);
                let (r, s) = (r2.clone(), s2.clone());
                tokio::spawn(async move {
                    let (rd, mut wr) = sock.into_split();
                    let mut rd = BufReader::new(rd);
                    loop {
                        let mut len = 0usize;
                        let mut line = String::new();
                        loop {
                            line.clear();
                            if rd.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            if line == "\r\n" {
                                break;
                            }
                            if let Some(v) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                len = v.trim().parse().unwrap_or(0);
                            }
                        }
                        let mut body = vec![0; len];
                        if rd.read_exact(&mut body).await.is_err() {
                            return;
                        }
                        r.fetch_add(1, Ordering::SeqCst);
                        s.lock().unwrap().push(Instant::now());
                        let answer = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
                        if wr.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let client = Client::new(&crate::config::NomadConfig::plain(&format!(
            "http://{addr}"
        )))
        .unwrap();
        let (tx, mut outcomes) = mpsc::unbounded_channel();
        let settings = ClaimSettings {
            ttl,
            lock_delay: ttl,
            fence_margin: ttl,
        };
        let r = Renewer::start(
            client,
            RecordTrust::Keys(Vec::new()),
            "node-1".into(),
            settings,
            BootClock::default(),
            Evidence::default(),
            tx,
        )
        .unwrap();
        let start = Instant::now();
        for i in 0..n {
            r.order(keep(i, false));
        }
        let mut renewed = BTreeSet::new();
        let deadline = tokio::time::Instant::now() + every * 3;
        while let Ok(Some(c)) = tokio::time::timeout_at(deadline, outcomes.recv()).await {
            match c {
                Completion::ClaimRenewed {
                    volume,
                    result,
                    sent,
                    ..
                } => {
                    assert!(result.is_ok(), "{result:?}");
                    assert!(sent >= start);
                    renewed.insert(volume);
                }
                other => panic!("{other:?}"),
            }
        }
        let last: Vec<Instant> = stamps
            .lock()
            .unwrap()
            .iter()
            .copied()
            .filter(|t| *t >= start + every * 2)
            .collect();
        let rate = last.len() as f64 / every.as_secs_f64();
        eprintln!(
            "{n} claims, TTL {ttl:?}: {} requests in {:?}, {rate:.1} requests/s in the last interval (expected {:.1}), {} connection(s)",
            reqs.load(Ordering::SeqCst),
            start.elapsed(),
            n as f64 / every.as_secs_f64(),
            conns.load(Ordering::SeqCst)
        );
        assert_eq!(conns.load(Ordering::SeqCst), 1, "one connection, reused");
        assert_eq!(renewed.len(), n, "every claim renewed");
    }

    /// A failure is retried after half an interval; a lost or released claim is no longer
    /// renewed; a stop ends the renewals; a stale lock's outcome changes nothing.
    #[test]
    fn outcomes_and_orders_change_the_schedule() {
        let every = Duration::from_secs(6);
        let t0 = Instant::now();
        let mut s = Schedule::new(every);
        s.order(keep(1, true), t0);
        let d = s.take(t0).unwrap();
        assert!(
            s.take(t0 + every * 2).is_none(),
            "one renewal of a claim at a time"
        );
        let failed = Err(ClaimError::Nomad {
            volume: key(1),
            source: crate::nomad::NomadError::Status {
                what: "lock-renew".into(),
                status: 500,
                body: "No cluster leader".into(),
            },
        });
        s.done(&d.volume, "lock-other", t0, &Ok(()));
        assert!(
            s.next_at().unwrap() > t0 + every * 100,
            "a stale lock's outcome is ignored"
        );
        s.done(&d.volume, &d.lock_id, t0, &failed);
        assert_eq!(s.next_at(), Some(t0 + every / 2));
        let d = s.take(t0 + every / 2).unwrap();
        s.done(
            &d.volume,
            &d.lock_id,
            t0 + every / 2,
            &Err(ClaimError::Lost { volume: key(1) }),
        );
        assert_eq!(s.len(), 0);
        s.order(keep(2, false), t0);
        s.order(Order::Stop { volume: key(2) }, t0);
        assert_eq!(s.next_at(), None);
    }
}
