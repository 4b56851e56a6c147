//! When a published volume's credentials are applied to its mount again, without an
//! unmount (the optional plugin operation `refresh`, docs/plugin-protocol.md "refresh";
//! Kubernetes CSI's `requiresRepublish`): at once when a Nomad Variable the volume
//! references changed (the shell's watch, [`crate::agent::secret_watch`], reports it), and
//! every `refresh_interval` its plugin's fingerprint declares.
//!
//! Only volumes published here (journal state `published`, the kernel's table showing the
//! target) whose plugin declares `refresh` are refreshed; a volume in another plugin call
//! (`busy`) waits for it, and a refresh makes the volume busy in turn, so it never overlaps
//! a publish or unpublish. A change seen while the volume is being published is kept and
//! applied once it is published (the publish may have read the value before the change).
//! A failed refresh is tried again after a backoff ([`RETRY_FIRST`] doubling up to
//! [`RETRY_MAX`]); the mount keeps serving with what it has. After an agent start, every
//! volume already published (restored from the journal) is refreshed once: a Variable may
//! have changed while no agent watched it.

use crate::node::journal::MountState;
use crate::storage::plugin::{Capability, Fingerprint};
use crate::volume::secret_refs::SecretRef;
use crate::volume::{VolumeKey, VolumeRecord};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The first wait after a failed refresh.
pub(crate) const RETRY_FIRST: Duration = Duration::from_secs(5);

/// The longest wait between two tries of a failing refresh.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(300);

/// A Nomad Variable a published volume references: (namespace, path).
pub(crate) type Watched = (String, String);

/// One failing refresh.
#[derive(Debug, Clone)]
struct Failing {
    count: u32,
    not_before: Instant,
    error: String,
}

/// What `dhv-binder status` shows of one volume's refreshes (`refresh.<volume>`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct RefreshStatus {
    /// Refreshes that succeeded since the agent started.
    pub done: u64,
    /// Failures in a row, and the last one's report (the plugin's words redacted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failing: Option<(u32, String)>,
    /// A change of a referenced Variable waits to be applied.
    pub pending: bool,
}

/// The refresh state, owned by the core.
#[derive(Debug, Default)]
pub(crate) struct Refreshes {
    /// When each published volume's credentials were last applied here (its publish, first
    /// seen published, or its last refresh).
    applied: BTreeMap<VolumeKey, Instant>,
    /// Each one's period (its plugin's `refresh_interval`).
    every: BTreeMap<VolumeKey, Duration>,
    /// Volumes a referenced Variable changed for since.
    wanted: BTreeSet<VolumeKey>,
    in_flight: BTreeSet<VolumeKey>,
    failing: BTreeMap<VolumeKey, Failing>,
    done: BTreeMap<VolumeKey, u64>,
    /// The first pass with the plugins known has run (the restored mounts were marked).
    started: bool,
}

/// The plugin of `rec` declares `refresh`: its fingerprint, else `None`.
fn refreshing<'a>(
    rec: &VolumeRecord,
    plugins: &'a BTreeMap<String, Result<Fingerprint, String>>,
) -> Option<&'a Fingerprint> {
    plugins
        .get(&rec.spec.plugin_id)
        .and_then(|f| f.as_ref().ok())
        .filter(|f| f.supports(Capability::Refresh))
}

/// The Variables a refresh follows: those referenced by every volume in the journal
/// (publishing, published or unpublishing here) whose plugin declares `refresh`.
pub(crate) fn watched(
    mounts: &crate::node::journal::Mounts,
    volumes: &crate::cluster::catalog::Catalogue,
    plugins: &BTreeMap<String, Result<Fingerprint, String>>,
) -> BTreeSet<Watched> {
    mounts
        .keys()
        .filter_map(|k| volumes.get(k))
        .filter(|r| refreshing(r, plugins).is_some())
        .flat_map(|r| {
            r.spec.secret_refs.values().filter_map(|s| match s {
                SecretRef::Variable { path, .. } => Some((r.spec.namespace.clone(), path.clone())),
                SecretRef::Vault { .. } => None,
            })
        })
        .collect()
}

impl Refreshes {
    /// Variable `path` in `namespace` changed: every volume in the journal that references
    /// it is refreshed once published (and not busy).
    pub(crate) fn variable_changed(
        &mut self,
        namespace: &str,
        path: &str,
        mounts: &crate::node::journal::Mounts,
        volumes: &crate::cluster::catalog::Catalogue,
    ) {
        for k in mounts.keys() {
            let Some(r) = volumes.get(k) else { continue };
            let names = r.spec.namespace == namespace
                && r.spec
                    .secret_refs
                    .values()
                    .any(|s| matches!(s, SecretRef::Variable { path: p, .. } if p == path));
            if names {
                self.wanted.insert(k.clone());
            }
        }
    }

    /// The volumes to refresh now, marked in flight (the caller marks them busy and emits
    /// the call). `mounted`: the targets the kernel's table shows published.
    pub(crate) fn due(
        &mut self,
        now: Instant,
        mounts: &crate::node::journal::Mounts,
        mounted: &BTreeSet<PathBuf>,
        busy: &BTreeSet<VolumeKey>,
        volumes: &crate::cluster::catalog::Catalogue,
        plugins: &BTreeMap<String, Result<Fingerprint, String>>,
    ) -> Vec<VolumeKey> {
        // Forget what is no longer in the journal; a volume not published (again) starts
        // over once it is (its publish reads the secrets).
        let published = |k: &VolumeKey| {
            mounts
                .get(k)
                .is_some_and(|m| m.state == MountState::Published)
        };
        if !std::mem::replace(&mut self.started, true) {
            // Published before this agent started: refreshed once, as after a change.
            self.wanted
                .extend(mounts.keys().filter(|k| published(k)).cloned());
        }
        self.wanted.retain(|k| mounts.contains_key(k));
        self.applied.retain(|k, _| published(k));
        self.every.retain(|k, _| published(k));
        self.failing.retain(|k, _| published(k));
        self.done.retain(|k, _| mounts.contains_key(k));
        let mut out = Vec::new();
        // Most nodes have no plugin that refreshes: then there is nothing to look up per
        // mount (this runs on every pass of the loop).
        let any = plugins
            .values()
            .any(|f| f.as_ref().is_ok_and(|f| f.supports(Capability::Refresh)));
        if !any {
            return out;
        }
        for (k, m) in mounts {
            if m.state != MountState::Published || busy.contains(k) || self.in_flight.contains(k) {
                continue;
            }
            // The plugin first: a lookup by key is cheaper than one by path.
            let Some(fp) = volumes.get(k).and_then(|r| refreshing(r, plugins)) else {
                continue;
            };
            if !mounted.contains(&m.target) {
                continue;
            }
            let applied = *self.applied.entry(k.clone()).or_insert(now);
            match fp.refresh_interval {
                Some(i) => self.every.insert(k.clone(), i),
                None => self.every.remove(k),
            };
            let by_period = self.every.get(k).is_some_and(|i| now >= applied + *i);
            let failed = self.failing.get(k);
            let due = match failed {
                Some(f) => now >= f.not_before,
                None => self.wanted.contains(k) || by_period,
            };
            if due {
                self.in_flight.insert(k.clone());
                // A change seen from here on is a new one.
                self.wanted.remove(k);
                out.push(k.clone());
            }
        }
        out
    }

    /// A refresh ended: `Ok` applied the credentials at `now`; `Err` (its report) is tried
    /// again after the backoff.
    pub(crate) fn done(&mut self, volume: &VolumeKey, result: Result<(), String>, now: Instant) {
        self.in_flight.remove(volume);
        match result {
            Ok(()) => {
                self.applied.insert(volume.clone(), now);
                self.failing.remove(volume);
                *self.done.entry(volume.clone()).or_default() += 1;
            }
            Err(error) => {
                let count = self.failing.get(volume).map_or(1, |f| f.count + 1);
                let wait = RETRY_FIRST
                    .saturating_mul(1 << (count - 1).min(16))
                    .min(RETRY_MAX);
                self.failing.insert(
                    volume.clone(),
                    Failing {
                        count,
                        not_before: now + wait,
                        error,
                    },
                );
            }
        }
    }

    /// When a refresh is next due without any input (a period ending, a retry).
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        self.every
            .iter()
            .filter(|(k, _)| !self.failing.contains_key(*k) && !self.in_flight.contains(*k))
            .filter_map(|(k, i)| Some(*self.applied.get(k)? + *i))
            .chain(self.failing.values().map(|f| f.not_before))
            .min()
    }

    /// Each volume's refreshes, for `dhv-binder status`.
    pub(crate) fn status(&self) -> BTreeMap<String, RefreshStatus> {
        let keys: BTreeSet<&VolumeKey> = self
            .done
            .keys()
            .chain(self.failing.keys())
            .chain(self.wanted.iter())
            .collect();
        keys.into_iter()
            .map(|k| {
                (
                    k.to_string(),
                    RefreshStatus {
                        done: self.done.get(k).copied().unwrap_or_default(),
                        failing: self.failing.get(k).map(|f| (f.count, f.error.clone())),
                        pending: self.wanted.contains(k),
                    },
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::reconcile::tests::{key, volume};

    fn fp(caps: &[&str], every: Option<u64>) -> Result<Fingerprint, String> {
        Ok(Fingerprint {
            version: "1.0.0".into(),
            deferred_bind: true,
            capabilities: caps.iter().map(|c| c.to_string()).collect(),
            max_volumes: None,
            topology: Default::default(),
            refresh_interval: every.map(Duration::from_secs),
        })
    }

    fn record(name: &str, plugin: &str, var: &str) -> VolumeRecord {
        let mut r = volume(name, "single-node-writer");
        r.spec.plugin_id = plugin.into();
        r.spec.secret_refs.insert(
            "password".into(),
            SecretRef::Variable {
                path: var.into(),
                item: "password".into(),
            },
        );
        r
    }

    fn mount(name: &str, plugin: &str, state: MountState) -> crate::node::journal::MountRecord {
        crate::node::journal::MountRecord {
            volume: key(name),
            volume_id: format!("id-{name}"),
            plugin_id: plugin.into(),
            state,
            target: PathBuf::from(format!("/mnt/{name}")),
            read_only: false,
            publish_context: Default::default(),
            since: 0,
            last_error: String::new(),
            claim_id: None,
            mount: None,
        }
    }

    struct World {
        mounts: crate::node::journal::Mounts,
        mounted: BTreeSet<PathBuf>,
        volumes: crate::cluster::catalog::Catalogue,
        plugins: BTreeMap<String, Result<Fingerprint, String>>,
    }

    fn world() -> World {
        let mut w = World {
            mounts: BTreeMap::new(),
            mounted: BTreeSet::new(),
            volumes: BTreeMap::new(),
            plugins: BTreeMap::new(),
        };
        w.plugins
            .insert("dav".into(), fp(&["fence", "refresh"], Some(600)));
        w.plugins.insert("plain".into(), fp(&["fence"], None));
        for (n, p, var) in [
            ("a", "dav", "dhv-binder-secrets/a"),
            ("b", "dav", "dhv-binder-secrets/b"),
            ("c", "plain", "dhv-binder-secrets/a"),
        ] {
            w.volumes
                .insert(key(n), std::sync::Arc::new(record(n, p, var)));
            w.mounts.insert(
                key(n),
                std::sync::Arc::new(mount(n, p, MountState::Published)),
            );
            w.mounted.insert(PathBuf::from(format!("/mnt/{n}")));
        }
        w
    }

    fn due(
        r: &mut Refreshes,
        w: &World,
        busy: &BTreeSet<VolumeKey>,
        now: Instant,
    ) -> Vec<VolumeKey> {
        r.due(now, &w.mounts, &w.mounted, busy, &w.volumes, &w.plugins)
    }

    /// Refreshes of an agent whose first pass found nothing published (what it publishes
    /// afterwards is not refreshed before a change or its period).
    fn started() -> Refreshes {
        let mut r = Refreshes::default();
        r.due(
            Instant::now(),
            &BTreeMap::new(),
            &BTreeSet::new(),
            &BTreeSet::new(),
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        r
    }

    #[test]
    fn what_an_agent_finds_published_at_its_start_is_refreshed_once() {
        let w = world();
        let mut r = Refreshes::default();
        let t0 = Instant::now();
        assert_eq!(
            due(&mut r, &w, &BTreeSet::new(), t0),
            vec![key("a"), key("b")]
        );
        r.done(&key("a"), Ok(()), t0);
        r.done(&key("b"), Ok(()), t0);
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
    }

    #[test]
    fn a_changed_variable_refreshes_the_published_volumes_that_reference_it_and_only_those() {
        let w = world();
        let mut r = started();
        let t0 = Instant::now();
        assert_eq!(
            watched(&w.mounts, &w.volumes, &w.plugins),
            [
                ("default".to_string(), "dhv-binder-secrets/a".to_string()),
                ("default".to_string(), "dhv-binder-secrets/b".to_string())
            ]
            .into_iter()
            .collect()
        );
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
        r.variable_changed("default", "dhv-binder-secrets/a", &w.mounts, &w.volumes);
        // Busy in another call: it waits.
        let busy: BTreeSet<VolumeKey> = [key("a")].into();
        assert!(due(&mut r, &w, &busy, t0).is_empty());
        // Volume c references it too, but its plugin has no refresh.
        assert_eq!(due(&mut r, &w, &BTreeSet::new(), t0), vec![key("a")]);
        // In flight: not twice.
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
        r.done(&key("a"), Ok(()), t0);
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
        assert_eq!(r.status()[&key("a").to_string()].done, 1);
        // Another namespace's variable of the same path is another variable.
        r.variable_changed("other", "dhv-binder-secrets/a", &w.mounts, &w.volumes);
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
    }

    #[test]
    fn the_plugins_period_refreshes_each_volume_and_a_failure_backs_off() {
        let w = world();
        let mut r = started();
        let t0 = Instant::now();
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
        assert_eq!(r.next_wakeup(), Some(t0 + Duration::from_secs(600)));
        let t1 = t0 + Duration::from_secs(600);
        assert_eq!(
            due(&mut r, &w, &BTreeSet::new(), t1),
            vec![key("a"), key("b")]
        );
        r.done(&key("a"), Ok(()), t1);
        r.done(&key("b"), Err("the server said no".into()), t1);
        assert_eq!(r.next_wakeup(), Some(t1 + RETRY_FIRST));
        assert!(due(&mut r, &w, &BTreeSet::new(), t1 + Duration::from_secs(4)).is_empty());
        let t2 = t1 + RETRY_FIRST;
        assert_eq!(due(&mut r, &w, &BTreeSet::new(), t2), vec![key("b")]);
        r.done(&key("b"), Err("again".into()), t2);
        assert_eq!(r.next_wakeup(), Some(t2 + RETRY_FIRST * 2));
        assert_eq!(
            r.status()[&key("b").to_string()].failing,
            Some((2, "again".into()))
        );
        // The backoff is bounded.
        let (mut t, mut a_at) = (t2, t1);
        for _ in 0..20 {
            t += RETRY_MAX;
            let d = due(&mut r, &w, &BTreeSet::new(), t);
            assert!(d.contains(&key("b")), "{d:?}");
            for k in d {
                if k == key("a") {
                    a_at = t;
                    r.done(&k, Ok(()), t);
                } else {
                    r.done(&k, Err("down".into()), t);
                }
            }
        }
        assert_eq!(
            r.next_wakeup(),
            Some((t + RETRY_MAX).min(a_at + Duration::from_secs(600)))
        );
        assert_eq!(
            r.status()[&key("b").to_string()]
                .failing
                .as_ref()
                .unwrap()
                .0,
            22
        );
    }

    #[test]
    fn a_change_while_publishing_is_applied_once_published_and_forgotten_once_unpublished() {
        let mut w = world();
        let mut r = started();
        let t0 = Instant::now();
        std::sync::Arc::make_mut(w.mounts.get_mut(&key("a")).unwrap()).state =
            MountState::Publishing;
        r.variable_changed("default", "dhv-binder-secrets/a", &w.mounts, &w.volumes);
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
        std::sync::Arc::make_mut(w.mounts.get_mut(&key("a")).unwrap()).state =
            MountState::Published;
        assert_eq!(due(&mut r, &w, &BTreeSet::new(), t0), vec![key("a")]);
        r.done(&key("a"), Ok(()), t0);
        // Unpublished: a change has nothing to refresh.
        w.mounts.remove(&key("a"));
        r.variable_changed("default", "dhv-binder-secrets/a", &w.mounts, &w.volumes);
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
        assert!(!r.status().contains_key(&key("a").to_string()));
        // Published in the journal but not on the kernel's table: left alone.
        r.variable_changed("default", "dhv-binder-secrets/b", &w.mounts, &w.volumes);
        w.mounted.remove(&PathBuf::from("/mnt/b"));
        assert!(due(&mut r, &w, &BTreeSet::new(), t0).is_empty());
    }
}
