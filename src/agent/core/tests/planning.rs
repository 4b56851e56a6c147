//! Planning: a scoped plan does what a full plan does (property test against a twin), and
//! bursts and waves cost work linear in their size.

use super::*;

/// A deterministic generator for the property tests (no dependency, reproducible).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

/// The effects as comparable lines (a commit's history, not its wall-clock stamps).
fn lines(e: &[Effect]) -> Vec<String> {
    let mut out = Vec::new();
    for x in e {
        match x {
            Effect::Commit { commit, then } => {
                out.push(format!("commit {} {:?}", commit.seq, commit.events()));
                out.extend(lines(then).into_iter().map(|l| format!("  {l}")));
            }
            Effect::Reply {
                answer: Answer::Status(_),
                to,
            } => out.push(format!("status {to:?}")),
            other => out.push(format!("{other:?}")),
        }
    }
    out
}

/// A call the world still owes the cores an answer for.
#[derive(Debug, Clone)]
enum Owed {
    Publish(VolumeKey),
    Unpublish(VolumeKey),
    Acquire(VolumeKey),
    Release(VolumeKey),
    Renew(VolumeKey, String),
    Commit(u64, Vec<Owed>),
}

fn owed(e: &[Effect], out: &mut Vec<Owed>) {
    for x in e {
        match x {
            Effect::Publish { volume, .. } => out.push(Owed::Publish(volume.key())),
            Effect::Unpublish { mount, .. } => out.push(Owed::Unpublish(mount.volume.clone())),
            Effect::AcquireClaim { volume, .. } => out.push(Owed::Acquire(volume.clone())),
            Effect::ReleaseClaim { volume, .. } => out.push(Owed::Release(volume.clone())),
            Effect::RenewClaim {
                volume, lock_id, ..
            } => out.push(Owed::Renew(volume.clone(), lock_id.clone())),
            Effect::Commit { commit, then } => {
                let mut calls = Vec::new();
                owed(then, &mut calls);
                out.push(Owed::Commit(commit.seq, calls));
            }
            _ => {}
        }
    }
}

/// Two cores fed the same inputs: one plans only dirty volumes, one plans everything.
struct Twin {
    scoped: Core,
    full: Core,
    t: Instant,
    owed: Vec<Owed>,
    mounted: BTreeSet<PathBuf>,
    allocs: BTreeMap<String, crate::nomad::types::Allocation>,
    index: u64,
    catalogues: [Catalogue; 3],
}

impl Twin {
    fn new() -> Self {
        let t = Instant::now();
        let mut full = Core::new(settings(), Journal::new(NODE), t);
        full.plan_everything();
        Twin {
            scoped: Core::new(settings(), Journal::new(NODE), t),
            full,
            t,
            owed: Vec::new(),
            mounted: BTreeSet::new(),
            allocs: BTreeMap::new(),
            index: 1,
            catalogues: {
                let ready: Catalogue = [
                    ("a", "single-node-writer"),
                    ("b", "multi-node-multi-writer"),
                    ("c", "multi-node-multi-writer"),
                ]
                .iter()
                .map(|(n, m)| (key(n), std::sync::Arc::new(volume(n, m))))
                .collect();
                let mut deleting = ready.clone();
                if let Some(c) = deleting.get_mut(&key("c")) {
                    std::sync::Arc::make_mut(c).state = VolumeState::Deleting;
                }
                let mut gone = ready.clone();
                gone.remove(&key("c"));
                [ready, deleting, gone]
            },
        }
    }

    /// Feeds both cores (the input is built twice: inputs are not `Clone`) and checks
    /// that they did the same.
    fn feed(&mut self, make: impl Fn() -> Input, step: &str) {
        let a = self.scoped.handle(make(), self.t);
        let b = self.full.handle(make(), self.t);
        assert_eq!(lines(&a), lines(&b), "after {step}");
        assert_eq!(self.scoped.waiting, self.full.waiting, "after {step}");
        owed(&a, &mut self.owed);
    }

    fn mount_table(&mut self) {
        let points = self.mounted.clone();
        self.feed(
            || Input::MountTable(MountTable::from_points(points.clone())),
            "mount table",
        );
    }

    /// The catalogue with volume `c` ready (0), being deleted (1) or gone (2); the
    /// records are made once (their IDs are random).
    fn catalogue(&mut self, c_state: usize) {
        let c = self.catalogues[c_state].clone();
        self.feed(|| Input::Catalogue(c.clone()), "catalogue");
    }

    fn answer(&mut self, o: Owed, ok: bool) {
        let err = || StepError::NotMounted {
            plugin: "bind".into(),
            target: target("x"),
        };
        match o {
            Owed::Publish(v) => {
                if ok {
                    self.mounted.insert(target(&v.name));
                    self.mount_table();
                }
                self.feed(
                    || {
                        Input::Done(Completion::Published {
                            volume: v.clone(),
                            result: if ok {
                                Ok(mounted_at(&v.name))
                            } else {
                                Err(err())
                            },
                            elapsed: Duration::from_millis(1),
                        })
                    },
                    "published",
                );
            }
            Owed::Unpublish(v) => {
                if ok {
                    self.mounted.remove(&target(&v.name));
                    self.mount_table();
                }
                self.feed(
                    || {
                        Input::Done(Completion::Unpublished {
                            volume: v.clone(),
                            result: if ok { Ok(()) } else { Err(err()) },
                        })
                    },
                    "unpublished",
                );
            }
            Owed::Acquire(v) => self.feed(
                || {
                    Input::Done(Completion::ClaimAcquired {
                        volume: v.clone(),
                        result: if ok {
                            Ok(format!("lock-{}", v.name).as_str().into())
                        } else {
                            Err(ClaimError::Held {
                                volume: v.clone(),
                                holder: "node-2".into(),
                                job: None,
                            })
                        },
                    })
                },
                "acquired",
            ),
            Owed::Release(v) => self.feed(
                || {
                    Input::Done(Completion::ClaimReleased {
                        volume: v.clone(),
                        result: Ok(()),
                    })
                },
                "released",
            ),
            Owed::Renew(v, lock_id) => {
                let t = self.t;
                self.feed(
                    || {
                        Input::Done(Completion::ClaimRenewed {
                            volume: v.clone(),
                            lock_id: lock_id.clone(),
                            sent: t,
                            result: if ok {
                                Ok(())
                            } else {
                                Err(ClaimError::Lost { volume: v.clone() })
                            },
                        })
                    },
                    "renewed",
                )
            }
            Owed::Commit(seq, calls) => {
                self.feed(
                    || Input::Committed {
                        seq,
                        result: if ok {
                            Ok(())
                        } else {
                            Err(JournalError::Write {
                                path: "/j".into(),
                                source: std::io::Error::other("disk full"),
                            })
                        },
                    },
                    "committed",
                );
                if ok {
                    self.owed.extend(calls);
                }
            }
        }
    }
}

/// Scoped planning (only the volumes a message can affect, found through the view's
/// volume index and the journal's user index) does exactly what planning every volume
/// on every pass does, over random sequences of allocation updates and removals,
/// relists, catalogue changes, lost mounts, failed and successful plugin, claim and
/// journal calls, and retries coming due.
#[test]
fn scoped_planning_does_what_a_full_plan_does() {
    let statuses = ["pending", "running", "complete", "failed", "lost"];
    let desired = ["run", "stop"];
    let sources: [&[&str]; 5] = [&["a"], &["b"], &["a", "b"], &["c"], &["b", "c"]];
    let ids = ["x1", "x2", "x3", "x4"];
    let mut r = Lcg(99);
    for _ in 0..60 {
        let mut w = Twin::new();
        w.mount_table();
        let fp = || Fingerprint {
            version: "1".into(),
            deferred_bind: true,
            capabilities: Vec::new(),
            ..Default::default()
        };
        w.feed(
            || {
                Input::Done(Completion::Plugins(BTreeMap::from([(
                    "bind".into(),
                    Ok(fp()),
                )])))
            },
            "plugins",
        );
        w.catalogue(0);
        w.feed(
            || {
                Input::Watch(WatchEvent::Relisted {
                    allocs: vec![],
                    index: 1,
                })
            },
            "first list",
        );
        for _ in 0..80 {
            match r.below(12) {
                0..=2 => {
                    w.index += 1;
                    let mut a = alloc(
                        ids[r.below(4)],
                        sources[r.below(5)],
                        statuses[r.below(5)],
                        desired[r.below(2)],
                    );
                    a.modify_index = w.index;
                    w.allocs.insert(a.id.to_string(), a.clone());
                    w.feed(
                        || Input::Watch(WatchEvent::Upsert(Box::new(a.clone()))),
                        "upsert",
                    );
                }
                3 => {
                    let id = ids[r.below(4)].to_string();
                    w.allocs.remove(&id);
                    w.feed(|| Input::Watch(WatchEvent::Removed(id.clone())), "removed");
                }
                4 if r.below(4) == 0 => {
                    let allocs: Vec<_> = w.allocs.values().cloned().collect();
                    let index = w.index;
                    w.feed(
                        || {
                            Input::Watch(WatchEvent::Relisted {
                                allocs: allocs.clone(),
                                index,
                            })
                        },
                        "relist",
                    );
                }
                5 if r.below(3) == 0 => w.catalogue(r.below(3)),
                6..=8 if !w.owed.is_empty() => {
                    let o = w.owed.remove(r.below(w.owed.len()));
                    let ok = r.below(5) != 0;
                    w.answer(o, ok);
                }
                9 if !w.mounted.is_empty() && r.below(3) == 0 => {
                    let lost = w.mounted.iter().nth(r.below(w.mounted.len())).cloned();
                    w.mounted.remove(&lost.unwrap());
                    w.mount_table();
                }
                _ => {
                    w.t += Duration::from_millis(r.below(4000) as u64);
                    w.feed(|| Input::Tick, "tick");
                }
            }
        }
        // `since` is the wall clock's second when each core recorded the change: the two
        // cores run one after the other and may straddle a second.
        let records = |c: &Core| {
            let mut m = c.journal().mounts().clone();
            m.values_mut()
                .for_each(|r| std::sync::Arc::make_mut(r).since = 0);
            m
        };
        assert_eq!(records(&w.scoped), records(&w.full));
        assert_eq!(w.scoped.journal().users(), w.full.journal().users());
    }
}

/// A core serving volumes `v0`..`v{n-1}`, one allocation each, placed and published
/// one at a time (each upsert plans its publish, each publish completes); returns the
/// core, the volume names and the planning work (visits) of the burst.
fn published_one_at_a_time(n: usize) -> (H, Vec<String>, u64) {
    let names: Vec<String> = (0..n).map(|i| format!("v{i}")).collect();
    let vols: Vec<(&str, &str)> = names
        .iter()
        .map(|n| (n.as_str(), "multi-node-multi-writer"))
        .collect();
    let mut h = H::new(&vols, vec![]);
    let before = h.core.plan_visits();
    for (i, name) in names.iter().enumerate() {
        let mut a = alloc(&format!("a{i:04}"), &[name], "pending", "run");
        a.modify_index = 10 + i as u64;
        let e = h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
        assert_eq!(publishes(&e), 1, "{e:?}");
        h.committed(&e);
        let points: Vec<PathBuf> = names[..=i].iter().map(|n| target(n)).collect();
        h.feed(Input::MountTable(MountTable::from_points(points)));
        let e = h.feed(Input::Done(Completion::Published {
            volume: key(name),
            result: Ok(mounted_at(name)),
            elapsed: Duration::from_millis(1),
        }));
        h.committed(&e);
    }
    assert_eq!(
        h.core.journal().users().len(),
        n,
        "every allocation is a user"
    );
    let work = h.core.plan_visits() - before;
    (h, names, work)
}

/// The planning work (visits of records, counted by the core) of a burst of `n`
/// allocations whose messages arrive one at a time.
fn burst_planning_work(n: usize) -> u64 {
    published_one_at_a_time(n).2
}

/// Issue 10: a 200-allocation burst whose messages arrive one at a time costs O(N)
/// planning work. Counted, not timed.
#[test]
fn a_burst_costs_planning_work_linear_in_its_size() {
    let w50 = burst_planning_work(50);
    let w200 = burst_planning_work(200);
    println!("planning work: N=50: {w50} visits, N=200: {w200} visits");
    assert_eq!(
        w200,
        4 * w50,
        "planning work is not linear: {w50} for 50, {w200} for 200"
    );
}

/// The planning work (visits of records, counted by the core) of stopping `n`
/// allocations one at a time after [`published_one_at_a_time`] published their volumes:
/// each stop plans an unpublish, each unpublish completes.
fn wave_planning_work(n: usize) -> u64 {
    let (mut h, names, _) = published_one_at_a_time(n);
    let points: Vec<PathBuf> = names.iter().map(|n| target(n)).collect();
    let before = h.core.plan_visits();
    for (i, name) in names.iter().enumerate().rev() {
        let mut a = alloc(&format!("a{i:04}"), &[name], "complete", "stop");
        a.modify_index = 10_000 + i as u64;
        let e = h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
        assert_eq!(unpublishes(&e), 1, "{name}: {e:?}");
        h.committed(&e);
        // The last mounted first: `from_points` numbers mounts by position, and the
        // mount IDs of the others must not change (they do not in a real table).
        h.feed(Input::MountTable(MountTable::from_points(
            points[..i].iter().cloned(),
        )));
        let e = h.feed(Input::Done(Completion::Unpublished {
            volume: key(name),
            result: Ok(()),
        }));
        h.committed(&e);
    }
    assert!(
        h.core.journal().mounts().is_empty(),
        "every volume unpublished"
    );
    h.core.plan_visits() - before
}

/// Issue 10: a wave of N unpublishes (a job of N allocations stopped) costs O(N)
/// work, chores included (a pass over every volume per unpublish made it O(N²)).
#[test]
fn a_wave_of_unpublishes_costs_work_linear_in_its_size() {
    let w50 = wave_planning_work(50);
    let w200 = wave_planning_work(200);
    println!("unpublish wave work: N=50: {w50} visits, N=200: {w200} visits");
    assert!(
        w200 <= 4 * w50 + 8,
        "the wave's work is not linear: {w50} for 50, {w200} for 200"
    );
}
