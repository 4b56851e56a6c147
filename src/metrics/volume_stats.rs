//! Each volume's usage and condition on this node, under kubelet's names
//! (`kubelet_volume_stats_*`, `pkg/kubelet/metrics/collectors/volume_stats.go`) with
//! `dhv_binder_` for `kubelet_` and the labels `namespace`, `volume` (kubelet's
//! `persistentvolumeclaim`) and `plugin`, so dashboards and alerts written for kubelet port
//! by a rename; and how long each has been unused here. These label values are volume
//! names: bounded by the volumes this node has published (and the unused-since times it
//! keeps), not by anything a task writes.

use crate::node::usage::Usage;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::sync::{Arc, Mutex};

/// One published volume's figures, as a [`VolumeStatsSource`] gives them at a scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeFigures {
    /// The volume's Nomad namespace (shared with the usage task's key).
    pub namespace: Arc<str>,
    /// The volume's name (shared with the usage task's key).
    pub volume: Arc<str>,
    /// The plugin that published it.
    pub plugin: String,
    /// Its usage; `None` while its mount does not answer (its usage series are left out,
    /// as kubelet leaves out a volume it cannot measure).
    pub usage: Option<Usage>,
    /// True when its condition is abnormal.
    pub abnormal: bool,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct VolumeLabels {
    namespace: String,
    volume: String,
    plugin: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct UnusedLabels {
    namespace: String,
    volume: String,
}

/// Where the usage families are read at each scrape: the usage task's own figures
/// (`crate::agent::volume_usage`), so that no copy of them is kept between scrapes (at
/// 1,000 published volumes a copy cost about 130 bytes of heap per volume; docs/scale.md,
/// memory per allocation).
pub trait VolumeStatsSource: Send + Sync {
    /// Every published volume's figures, and the unused-since times (namespace, volume,
    /// Unix seconds its last user went away) of the volumes no longer used here, as they
    /// are now. Built for one scrape and dropped after it.
    fn read(&self) -> (Vec<VolumeFigures>, Vec<Unused>);
}

/// A volume no longer used here: (namespace, volume, Unix seconds its last user went away).
pub type Unused = (Arc<str>, Arc<str>, u64);

/// The usage families, read from the [`VolumeStatsSource`] at each scrape (none: no
/// series).
#[derive(Default, Clone)]
pub(super) struct VolumeStatsCollector(Arc<Mutex<Option<Arc<dyn VolumeStatsSource>>>>);

impl std::fmt::Debug for VolumeStatsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VolumeStatsCollector")
    }
}

impl VolumeStatsCollector {
    /// Reads the figures from `source` from now on.
    pub(super) fn read_from(&self, source: Arc<dyn VolumeStatsSource>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(source);
    }
}

/// The usage families: name (after `dhv_binder_`), help, and the figure.
type UsageFamily = (&'static str, &'static str, fn(&Usage) -> u64);

const USAGE: [UsageFamily; 6] = [
    (
        "volume_stats_capacity_bytes",
        "Capacity of the filesystem a published volume is on, bytes, by statfs of its mount (kubelet_volume_stats_capacity_bytes)",
        |u| u.capacity_bytes,
    ),
    (
        "volume_stats_used_bytes",
        "Bytes in use on the filesystem a published volume is on (kubelet_volume_stats_used_bytes)",
        |u| u.used_bytes,
    ),
    (
        "volume_stats_available_bytes",
        "Bytes a writer may still use on the filesystem a published volume is on (kubelet_volume_stats_available_bytes)",
        |u| u.available_bytes,
    ),
    (
        "volume_stats_inodes",
        "Inodes of the filesystem a published volume is on (kubelet_volume_stats_inodes)",
        |u| u.inodes,
    ),
    (
        "volume_stats_inodes_used",
        "Inodes in use on the filesystem a published volume is on (kubelet_volume_stats_inodes_used)",
        |u| u.inodes_used,
    ),
    (
        "volume_stats_inodes_free",
        "Free inodes on the filesystem a published volume is on (kubelet_volume_stats_inodes_free)",
        |u| u.inodes_free,
    ),
];

/// Every family this collector exports (with the registry's prefix).
#[cfg(test)]
pub(super) const FAMILIES: [&str; 8] = [
    "dhv_binder_volume_stats_capacity_bytes",
    "dhv_binder_volume_stats_used_bytes",
    "dhv_binder_volume_stats_available_bytes",
    "dhv_binder_volume_stats_inodes",
    "dhv_binder_volume_stats_inodes_used",
    "dhv_binder_volume_stats_inodes_free",
    "dhv_binder_volume_stats_health_status_abnormal",
    "dhv_binder_volume_unused_seconds",
];

impl prometheus_client::collector::Collector for VolumeStatsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let source = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (volumes, unused) = source.map(|s| s.read()).unwrap_or_default();
        let labels = |v: &VolumeFigures| VolumeLabels {
            namespace: v.namespace.to_string(),
            volume: v.volume.to_string(),
            plugin: v.plugin.clone(),
        };
        for (name, help, figure) in USAGE {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for v in &volumes {
                if let Some(u) = &v.usage {
                    let g = ConstGauge::new(i64::try_from(figure(u)).unwrap_or(i64::MAX));
                    g.encode(family.encode_family(&labels(v))?)?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "volume_stats_health_status_abnormal",
            "1 when a published volume's condition is abnormal (its mount does not answer, its server is gone, its plugin reports it degraded or damaged), else 0 (kubelet_volume_stats_health_status_abnormal)",
            None,
            MetricType::Gauge,
        )?;
        for v in &volumes {
            ConstGauge::new(i64::from(v.abnormal)).encode(family.encode_family(&labels(v))?)?;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let mut family = encoder.encode_descriptor(
            "volume_unused_seconds",
            "Seconds since a volume's last user on this node went away (a volume in use here, or never used here, has no series)",
            None,
            MetricType::Gauge,
        )?;
        for (namespace, volume, since) in &unused {
            let g = ConstGauge::new(i64::try_from(now.saturating_sub(*since)).unwrap_or(i64::MAX));
            g.encode(family.encode_family(&UnusedLabels {
                namespace: namespace.to_string(),
                volume: volume.to_string(),
            })?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::Metrics;

    use super::*;

    #[test]
    fn usage_condition_and_unused_time_are_exported_under_kubelets_names() {
        let m = Metrics::new();
        let u = Usage {
            capacity_bytes: 1000,
            used_bytes: 400,
            available_bytes: 600,
            inodes: 10,
            inodes_used: 3,
            inodes_free: 7,
        };
        struct Fixed(Vec<VolumeFigures>, Vec<Unused>);
        impl VolumeStatsSource for Fixed {
            fn read(&self) -> (Vec<VolumeFigures>, Vec<Unused>) {
                (self.0.clone(), self.1.clone())
            }
        }
        m.read_volume_stats_from(Arc::new(Fixed(
            vec![
                VolumeFigures {
                    namespace: "default".into(),
                    volume: "data".into(),
                    plugin: "ext4".into(),
                    usage: Some(u),
                    abnormal: false,
                },
                VolumeFigures {
                    namespace: "default".into(),
                    volume: "hung".into(),
                    plugin: "webdav".into(),
                    usage: None,
                    abnormal: true,
                },
            ],
            vec![("default".into(), "idle".into(), 0)],
        )));
        let text = m.encode();
        for line in [
            r#"dhv_binder_volume_stats_capacity_bytes{namespace="default",volume="data",plugin="ext4"} 1000"#,
            r#"dhv_binder_volume_stats_used_bytes{namespace="default",volume="data",plugin="ext4"} 400"#,
            r#"dhv_binder_volume_stats_available_bytes{namespace="default",volume="data",plugin="ext4"} 600"#,
            r#"dhv_binder_volume_stats_inodes{namespace="default",volume="data",plugin="ext4"} 10"#,
            r#"dhv_binder_volume_stats_inodes_used{namespace="default",volume="data",plugin="ext4"} 3"#,
            r#"dhv_binder_volume_stats_inodes_free{namespace="default",volume="data",plugin="ext4"} 7"#,
            r#"dhv_binder_volume_stats_health_status_abnormal{namespace="default",volume="data",plugin="ext4"} 0"#,
            r#"dhv_binder_volume_stats_health_status_abnormal{namespace="default",volume="hung",plugin="webdav"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "no {line} in:\n{text}");
        }
        assert!(
            !text.contains(r#"volume_stats_used_bytes{namespace="default",volume="hung""#),
            "a mount that does not answer has no usage:\n{text}"
        );
        let idle = text
            .lines()
            .find(|l| {
                l.starts_with(
                    r#"dhv_binder_volume_unused_seconds{namespace="default",volume="idle"}"#,
                )
            })
            .unwrap_or_else(|| panic!("{text}"));
        assert!(idle.rsplit(' ').next().unwrap().parse::<i64>().unwrap() > 1_000_000);
    }
}
