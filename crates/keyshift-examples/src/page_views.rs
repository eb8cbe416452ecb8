//! Page views per page in tumbling event-time windows: a window aggregate whose records are
//! combined before the shuffle (`KeyedStream::window_aggregate`), so a popular page, a hot key,
//! costs its subtask one merge per source batch instead of one update per view.

use crate::input::Rng;
use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// A user's view of a page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub user: String,
    pub page: String,
    pub ts: i64,
}

/// Counts views (associative and commutative: the sources may combine it).
#[derive(Debug, Clone, Copy)]
pub struct CountViews;

impl AggregateFunction for CountViews {
    type In = View;
    type Acc = u64;
    type Out = u64;

    fn create(&self) -> u64 {
        0
    }

    fn add(&self, _view: View, acc: u64) -> u64 {
        acc + 1
    }

    fn result(&self, acc: &u64) -> u64 {
        *acc
    }
}

impl MergingAggregate for CountViews {
    fn merge(&self, a: u64, b: u64) -> u64 {
        a + b
    }
}

/// One page's views in one window.
pub type PageViews = WindowResult<String, u64>;

/// The whole job: views `{"user", "page", "ts"}` from source `views`, counted per page in
/// tumbling windows of `window`, each window's count once it closes (sink `windows`).
pub fn job(window: Duration) -> Job {
    Job::json_lines::<View>("page-views", "views", |v| v.ts)
        .key_by(|v| v.page.clone())
        .window_aggregate("views-per-page", window, CountViews)
        .to_json_lines("windows")
}

/// Deterministic views: `views` of them `step_ms` apart in event time (in order, so none is
/// late), by `users` users, on `pages` pages of which the first, `/home`, gets `hot_percent`
/// of them and the others the rest alike.
#[derive(Debug, Clone)]
pub struct Traffic {
    pub views: u64,
    pub users: u64,
    pub pages: u64,
    pub hot_percent: u64,
    pub step_ms: i64,
    pub seed: u64,
}

impl Traffic {
    /// The views, in arrival (and event-time) order.
    pub fn records(&self) -> Vec<View> {
        let mut rng = Rng::new(self.seed);
        (0..self.views)
            .map(|i| {
                let page = match rng.below(100) < self.hot_percent {
                    true => "/home".to_owned(),
                    false => format!("/page-{}", 1 + rng.below(self.pages.max(2) - 1)),
                };
                View {
                    user: format!("user-{}", rng.below(self.users)),
                    page,
                    ts: i as i64 * self.step_ms,
                }
            })
            .collect()
    }
}

/// Every page's count in every window of `window_ms` that has a view, computed from the views
/// alone, sorted.
pub fn expected(views: &[View], window_ms: i64) -> Vec<PageViews> {
    let mut counts: BTreeMap<(String, i64), u64> = BTreeMap::new();
    for v in views {
        let start = v.ts - v.ts.rem_euclid(window_ms);
        *counts.entry((v.page.clone(), start)).or_insert(0) += 1;
    }
    counts
        .into_iter()
        .map(|((page, start), n)| WindowResult {
            key: page,
            start,
            end: start + window_ms,
            result: n,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_counts_each_pages_views_per_window_as_the_oracle_does() {
        let traffic = Traffic {
            views: 3_000,
            users: 40,
            pages: 12,
            hot_percent: 30,
            step_ms: 7,
            seed: 3,
        };
        let views = traffic.records();
        let hot = views.iter().filter(|v| v.page == "/home").count();
        assert!((800..1_000).contains(&hot), "{hot} of 3000 views on /home");
        let lines: Vec<String> = views
            .iter()
            .map(|v| serde_json::to_string(v).unwrap())
            .collect();
        let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
        let out =
            keyshift_sdk::testing::run_job(&job(Duration::from_secs(1)), &refs, 3, 128, 0, 64)
                .unwrap();
        let mut got: Vec<PageViews> = out
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        got.sort();
        assert_eq!(got, expected(&views, 1_000));
    }
}
