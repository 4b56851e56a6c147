//! Publish latency as a fixed-size histogram: memory does not grow with the number of
//! publishes (the status shows the count and an upper bound of the median).

/// Bucket upper bounds in milliseconds; the last bucket holds everything slower.
const BOUNDS_MS: [u64; 16] = [
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1_000,
    2_000,
    5_000,
    10_000,
    30_000,
    60_000,
    u64::MAX,
];

/// Counts of publish durations by bucket, and the last one as measured.
#[derive(Debug, Default, Clone)]
pub(crate) struct Latency {
    counts: [u64; BOUNDS_MS.len()],
    last: Option<u64>,
}

impl Latency {
    /// Records one publish that took `ms` milliseconds.
    pub(crate) fn record(&mut self, ms: u64) {
        let i = BOUNDS_MS
            .iter()
            .position(|b| ms <= *b)
            .unwrap_or(BOUNDS_MS.len() - 1);
        self.counts[i] += 1;
        self.last = Some(ms);
    }

    /// How long the last publish took (ms, measured); `None` before the first.
    pub(crate) fn last(&self) -> Option<u64> {
        self.last
    }

    /// How many publishes were recorded.
    pub(crate) fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The upper bound (ms) of the bucket holding the median, `None` when empty; the
    /// slowest bucket reports the bound below it.
    pub(crate) fn median_bound(&self) -> Option<u64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen * 2 > n {
                return Some(if BOUNDS_MS[i] == u64::MAX {
                    BOUNDS_MS[i - 1]
                } else {
                    BOUNDS_MS[i]
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_in_fixed_buckets_and_bounds_the_median() {
        let mut l = Latency::default();
        assert_eq!(l.median_bound(), None);
        for ms in [3, 4, 40, 4, 900_000] {
            l.record(ms);
        }
        assert_eq!(l.count(), 5);
        assert_eq!(l.last(), Some(900_000), "the last one, as measured");
        assert_eq!(l.median_bound(), Some(5));
        for _ in 0..100_000 {
            l.record(7);
        }
        assert_eq!(l.median_bound(), Some(10));
        assert_eq!(
            std::mem::size_of::<Latency>(),
            16 * 8 + 16,
            "fixed size: the buckets and the last value"
        );
    }
}
