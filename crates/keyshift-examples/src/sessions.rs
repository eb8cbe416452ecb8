//! Sessionization by user: each user's clicks at most a gap apart form one session, emitted
//! once the watermark passes its end with its click count and the pages it visited. Sessions
//! merge when a late-arriving click bridges two of them; the session is keyed state of its
//! user, so it moves as one through every rescale.

use crate::input::{Rng, jitter};
use keyshift_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// A user's click on a page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Click {
    pub user: String,
    pub page: String,
    pub ts: i64,
}

/// What a session keeps and reports: its clicks and the distinct pages they were on.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Visits {
    pub clicks: u64,
    pub pages: BTreeSet<String>,
}

/// The session aggregate: counts clicks and collects pages.
#[derive(Debug, Clone, Copy)]
pub struct CountVisits;

impl AggregateFunction for CountVisits {
    type In = Click;
    type Acc = Visits;
    type Out = Visits;

    fn create(&self) -> Visits {
        Visits::default()
    }

    fn add(&self, click: Click, mut acc: Visits) -> Visits {
        acc.clicks += 1;
        acc.pages.insert(click.page);
        acc
    }

    fn result(&self, acc: &Visits) -> Visits {
        acc.clone()
    }
}

impl MergingAggregate for CountVisits {
    fn merge(&self, mut a: Visits, b: Visits) -> Visits {
        a.clicks += b.clicks;
        a.pages.extend(b.pages);
        a
    }
}

/// One closed session of a user.
pub type UserSession = Session<String, Visits>;

/// The whole job: JSON clicks from source `clicks` (those without a user dropped), sessions
/// with `gap` to sink `sessions`.
pub fn job(gap: Duration) -> Job {
    Job::json_lines::<Click>("sessions", "clicks", |c| c.ts)
        .filter(|c| !c.user.is_empty())
        .key_by(|c| c.user.clone())
        .process("sessions", move || EventTimeSessions::new(gap, CountVisits))
        .to_json_lines("sessions")
}

/// Generated clicks: `users` users, each with `sessions_per_user` bursts of 1 to
/// `max_clicks` clicks less than a gap apart, bursts separated by more than a gap, over
/// `pages` pages. Clicks arrive out of order (within the bounded out-of-orderness, so none is
/// late): a click often arrives after later ones of its burst that began sessions of their
/// own, and bridges them (a merge).
#[derive(Debug, Clone, Copy)]
pub struct Browsing {
    pub users: u64,
    pub sessions_per_user: u64,
    pub max_clicks: u64,
    pub pages: u64,
    pub gap_ms: i64,
    pub max_out_of_orderness: i64,
    pub seed: u64,
}

impl Browsing {
    /// The clicks in arrival order, as (key, event time, click).
    pub fn records(&self) -> Vec<(String, i64, Click)> {
        let mut rng = Rng::new(self.seed);
        let mut clicks = Vec::new();
        for u in 0..self.users {
            let user = format!("user-{u}");
            let mut t = rng.below(self.gap_ms as u64) as i64;
            for _ in 0..self.sessions_per_user {
                let n = 1 + rng.below(self.max_clicks);
                for _ in 0..n {
                    let page = format!("/page/{}", rng.below(self.pages));
                    clicks.push((
                        t,
                        Click {
                            user: user.clone(),
                            page,
                            ts: t,
                        },
                    ));
                    t += 1 + rng.below((self.gap_ms - 1).max(1) as u64) as i64;
                }
                // The next burst starts more than a gap after this one's last click (the step
                // just taken is under a gap: add one).
                t += self.gap_ms + rng.below(self.gap_ms as u64) as i64;
            }
        }
        clicks.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.user.cmp(&b.1.user)));
        jitter(clicks, self.max_out_of_orderness, &mut rng)
            .into_iter()
            .map(|(ts, c)| (c.user.clone(), ts, c))
            .collect()
    }
}

/// The oracle: per user, the clicks sorted by time, cut wherever two consecutive clicks are
/// more than `gap_ms` apart; each run is a session from its first click to its last plus the
/// gap. Computed from the clicks alone.
pub fn expected(records: &[(String, i64, Click)], gap_ms: i64) -> Vec<UserSession> {
    let mut by_user: BTreeMap<&str, Vec<&Click>> = BTreeMap::new();
    for (_, _, c) in records {
        by_user.entry(&c.user).or_default().push(c);
    }
    let mut out = Vec::new();
    for (user, mut clicks) in by_user {
        clicks.sort_by_key(|c| c.ts);
        let mut i = 0;
        while i < clicks.len() {
            let mut j = i;
            while j + 1 < clicks.len() && clicks[j + 1].ts - clicks[j].ts <= gap_ms {
                j += 1;
            }
            let run = &clicks[i..=j];
            out.push(Session {
                key: user.to_owned(),
                start: run[0].ts,
                end: run[run.len() - 1].ts + gap_ms,
                result: Visits {
                    clicks: run.len() as u64,
                    pages: run.iter().map(|c| c.page.clone()).collect(),
                },
            });
            i = j + 1;
        }
    }
    out.sort();
    out
}
